"""online_contraction: a contraction over the axis of a (max, Σ exp) row statistic as ONE kernel
(tecc.passes.rewrite.online_contraction): attention, masked or biased, with grouped heads, or a
softmax followed by a contraction. Three graph-level strategies (registry.GraphStrategy), guarded
by the recognizer (`online_chain`: the algebraic precondition, never an op's name), each a form
of the same rewrite, all ranked by the cost model against each other and against the unfused
per-kernel plans (four kernels that write the rows × keys score matrix and read it back three
times):

* `online_contraction_wgmma` (sm_90: the Hopper form, online_contraction_mma(wgmma=True): one
  warpgroup per 64 query rows, S = Q·Kᵀ and O += P·V as wgmma with P from registers, Q/K/V in
  swizzled shared memory read through descriptors); its points are `wgmma_tilings`;
* `online_contraction_mma` (sm_80+, float16/bfloat16 operands, head dims 16..128 or 96: the
  mma.sync form, K/V tiles staged per block through a cp.async ring); its points `mma_tilings`;
* `online_contraction` (SIMT: 32 lanes per row, 4 rows per block, key tiles of 32; any dtype,
  a constant column extent): the form when tensor cores do not apply.

Every tensor-core point is priced by the fitted block cost of tecc.compiler.cost.attention
(F + t·tiles + m·guarded tiles at the blocks per SM the kernel runs at), with the key tiles each
block visits proven by isl (`proven_tiles`: a mask that skips tiles lowers the mean). The blocks
per SM come from the tiling's nominal registers (ptxas's, `NOMINAL_REGISTERS`), or, when the
mask skips tiles (where the guard's registers decide an occupancy step: docs/attention.md), from
ptxas itself: the tiling is compiled as the build would compile it (NVRTC, cached, so the
build's compile is the same one), in its plain form and, where registers keep it below the
blocks its shared memory allows, with the guarded tiles peeled into a loop of their own, and the
form that fits more blocks is the point. The planner then realizes the cheapest point whose
kernel compiles without spills or serialized wgmmas (its compile check), and the plan's reason
says which tilings it passed over. Each point carries what the plan step needs: split-KV when
the query blocks cannot fill the GPU (`kv_split_choice`), the launch order query block major
when the blocks' tile counts differ (`launches_query_major`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ...codegen import KernelResources, dynamic_shared_bytes
from ...ir import dtype as dt
from ...ir.errors import ScheduleError, TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Expr, Reduce, TensorRead, Var, const_int, walk
from ...ir.poly import affine_coefficients
from ...passes.manager import PassTiming
from ...passes.rewrite.key_tiles import key_tile_bound, unmasked_tile_bound
from ...passes.rewrite.online_contraction import OnlineChain, online_chain
from ...passes.rewrite.online_contraction_mma import (
    TensorCoreChain,
    describe_skipping,
    mma_sync_head_dims,
    tensor_core_chain,
)
from ...passes.rewrite.online_mma_chain import element_strides
from ..cost.attention import AttentionLaunch, Tiling, attention_workload, head_dim_class, simt_workload
from ..cost.analysis import DEFAULT_SIZE
from ..cost.model import Workload, predict
from ..cost.occupancy import occupancy
from ..pipeline import compile_module, schedule_module, wgmma_serialized
from ..plan import Plan, Step
from ..program import Program
from .registry import GraphStrategy, Point, register

THREADS = 32
ROWS_PER_BLOCK = 4
MMA_MIN_ARCH = 80  # mma.sync.m16n8k16, ldmatrix and cp.async: sm_80
WGMMA_ARCH = 90    # wgmma: sm_90a only
NOMINAL_LENGTH = 8192   # a symbolic row or key extent is costed at this length (the fits')
MIN_CHUNK_TILES = 4     # a key chunk of fewer tiles spends more on its prologue, ring fill and partials


def mma_tilings(widest: int) -> tuple[tuple[int, int, int], ...]:
    """(rows_per_block, key_tile, warp_rows) of the mma.sync form for head dims up to `widest`
    (the space; the cost model orders it: benchmarks/attention_tilings.py on an H200 timed the
    first two of each, cost/attention.py)."""
    if widest > 64:
        return ((64, 64, 16), (64, 32, 16), (128, 32, 16))
    return ((128, 64, 32), (64, 64, 16), (128, 64, 16), (64, 32, 16))


def wgmma_tilings(widest: int) -> tuple[tuple[int, int, int, bool], ...]:
    """(rows_per_block, key_tile, blocks_per_sm, overlap) of the Hopper form for head dims up to
    `widest` (blocks_per_sm 0: no launch-bounds request): the space, ordered by the cost model.
    d = 256 keeps 64-key tiles (O is 128 float32 registers per thread, and 128-key K/V tiles would
    not fit shared memory)."""
    if widest > 128:
        return ((128, 64, 0, False), (64, 64, 0, False))
    if widest > 64:
        return ((128, 64, 0, False), (128, 128, 0, False), (64, 64, 0, False), (128, 64, 0, True),
                (128, 128, 0, True))
    return ((128, 128, 0, False), (64, 64, 4, False), (128, 64, 2, False), (128, 64, 2, True), (128, 128, 0, True))


# ptxas's registers per thread of each tiling without a mask (sm_90a / sm_80, S = 200..1024,
# docs/attention.md's tables; the blocks per SM they give decide which fit prices the tiling):
# (form, head-dim class, rows, key tile, warp rows or blocks-per-SM request, overlapped)
NOMINAL_REGISTERS: dict[tuple[str, int, int, int, int, bool], int] = {
    ("wgmma", 64, 128, 128, 0, False): 128, ("wgmma", 64, 128, 64, 0, False): 95,
    ("wgmma", 64, 128, 64, 2, False): 102, ("wgmma", 64, 64, 64, 4, False): 103,
    ("wgmma", 64, 64, 64, 0, False): 103, ("wgmma", 64, 128, 128, 0, True): 177,
    ("wgmma", 64, 128, 64, 2, True): 118, ("wgmma", 64, 128, 64, 0, True): 120,
    ("wgmma", 128, 128, 128, 0, False): 172, ("wgmma", 128, 128, 64, 0, False): 127,
    ("wgmma", 128, 64, 64, 0, False): 158, ("wgmma", 128, 128, 64, 0, True): 165,
    ("wgmma", 128, 128, 128, 0, True): 226, ("wgmma", 256, 128, 64, 0, False): 218,
    ("wgmma", 256, 64, 64, 0, False): 249,
    ("mma.sync", 64, 128, 64, 32, False): 249, ("mma.sync", 64, 64, 64, 16, False): 165,
    ("mma.sync", 64, 128, 64, 16, False): 168, ("mma.sync", 64, 64, 32, 16, False): 128,
    ("mma.sync", 128, 64, 64, 16, False): 243, ("mma.sync", 128, 64, 32, 16, False): 200,
    ("mma.sync", 128, 128, 32, 16, False): 200,
}


def nominal_registers(form: str, widest: int, rows: int, key_tile: int, variant: int, overlap: bool) -> int:
    """NOMINAL_REGISTERS of a tiling; a tiling not in the table: the accumulators it keeps per
    thread (O, S, P) plus 40, at most 255."""
    found = NOMINAL_REGISTERS.get((form, head_dim_class(widest), rows, key_tile, variant, overlap))
    if found is not None:
        return found
    per_row_threads = 4 if form == "mma.sync" else 4 * (rows // 64) * 32 // rows
    return min(255, 40 + (widest + key_tile + key_tile // 2) // max(per_row_threads, 1))


def shared_bytes(rows: int, key_tile: int, depth: int, columns: int, itemsize: int, stages: int) -> int:
    """The tiling's shared memory: the Q tile and a ring of K and V tiles."""
    return itemsize * (rows * depth + stages * key_tile * (depth + columns))


# ---- the program's chain, recognized once -------------------------------------------------------

class ChainFacts:
    """The recognized chain of a program and what every form's guard, space and cost read."""

    def __init__(self, program: Program, chain: OnlineChain, unset: int = NOMINAL_LENGTH) -> None:
        self.program = program
        self.chain = chain
        self.tcc: TensorCoreChain | None = None
        self.not_tensor_cores = ""
        try:
            self.tcc = tensor_core_chain(chain)
        except ScheduleError as exc:
            self.not_tensor_cores = str(exc)
        self.columns = const_int(chain.columns) or 0
        self.depth = self.tcc.depth if self.tcc is not None else self.columns
        self.widest = max(self.depth, self.columns)
        env = {v: int(program.sizes.get(v.name, unset)) for e in (*chain.rows, chain.keys)
               for v in walk(e) if isinstance(v, Var)}
        # the sizes the extents were evaluated at (proven_tiles' `sizes`)
        self.sizes = {v.name: value for v, value in env.items()}
        self.queries = _value(chain.rows[-1], env)
        self.keys = _value(chain.keys, env)
        self.heads = 1
        for h in chain.rows[:-1]:
            self.heads *= _value(h, env)
        inputs = [t for t in program.tensors if t.is_placeholder]
        self.itemsize = min((t.dtype.bits // 8 for t in inputs), default=2)
        self.dtype = str(self.tcc.q.tensor.dtype) if self.tcc is not None else "float32"


def _value(e: Expr, env: Mapping[Var, int]) -> int:
    try:
        return max(1, evaluate_int(e, dict(env)))
    except TeccError:
        return NOMINAL_LENGTH


def chain_facts(program: Program) -> ChainFacts | str:
    """The program's ChainFacts, or why it is no online chain (memoized per program)."""
    def recognize() -> ChainFacts | str:
        try:
            chain = online_chain(program.args)
        except ScheduleError as exc:
            return str(exc).splitlines()[0]
        if const_int(chain.columns) is None:
            return "the output's column extent is symbolic (the partial output lives in registers)"
        return ChainFacts(program, chain)
    return program.memo("online_contraction/chain", recognize)


def priced_facts(program: Program) -> ChainFacts:
    """The chain's facts with every symbolic extent the program does not size at the per-kernel
    analysis' DEFAULT_SIZE: what a rewrite point is predicted at (`workload`), so that it is
    weighed against the per-kernel plans of the kernels it replaces at the same extents. The
    points are still ordered at NOMINAL_LENGTH (`order`, chain_facts): the fits' length. At
    8192 for B and S against the per-kernel plans' 1024, a symbolic attention's online form was
    priced ~400x the per-kernel plans' (B·H 64x, S² 64x) and its (B, H, S, S) scores materialized."""
    facts = chain_facts(program)
    assert isinstance(facts, ChainFacts)
    if all(const_int(e) is not None for e in (*facts.chain.rows, facts.chain.keys)):
        return facts
    return program.memo("online_contraction/priced", lambda: ChainFacts(program, facts.chain, DEFAULT_SIZE))


def proven_tiles(chain: OnlineChain, rows: int, key_tile: int, sizes: Mapping[str, int] | None = None
                 ) -> tuple[float, float, float, int] | None:
    """(mean visited key tiles per block, mean guarded ones, all tiles of a row, blocks) of the
    blocks of `rows` query rows, from the isl-proven bounds (key_tiles.py) evaluated at `sizes`
    (a symbolic extent without one at NOMINAL_LENGTH); None when the mask gives no proven bound
    (every block visits every tile: nothing is skipped)."""
    block = Var("query_block", dt.int32)
    bound = key_tile_bound(chain, block, rows, key_tile)
    if bound is None:
        return None
    unmasked = unmasked_tile_bound(chain, block, rows, key_tile)
    exprs: list[Expr] = [chain.rows[-1], chain.keys, bound[0]] + ([unmasked] if unmasked is not None else [])
    given = dict(sizes or {})
    env: dict[Var, int] = {v: int(given.get(v.name, NOMINAL_LENGTH)) for e in exprs for v in walk(e)
                           if isinstance(v, Var) and v is not block}
    try:
        blocks = evaluate_int((chain.rows[-1] + (rows - 1)) // rows, env)
        whole = evaluate_int((chain.keys + (key_tile - 1)) // key_tile, env)
        visited = [evaluate_int(bound[0], {**env, block: b}) for b in range(blocks)]
        plain = [min(n, evaluate_int(unmasked, {**env, block: b})) if unmasked is not None else 0
                 for b, n in enumerate(visited)]
    except TeccError:
        return None
    if blocks <= 0:
        return None
    return (sum(visited) / blocks, sum(n - p for n, p in zip(visited, plain)) / blocks, float(whole), blocks)


def launches_query_major(chain: OnlineChain, rows: int, key_tile: int, splits: int, overlap: bool) -> bool:
    """Whether the Hopper plan of this tiling launches query block major over all heads
    (`query_major`): when the blocks' isl-proven key tile counts differ (the mask skips tiles),
    every head's longest block should start before any shorter one (measured on the H200, causal
    d = 128, S = 8k, 128x64: 1139 -> 1068 us; docs/attention.md "Launch order"); not with a key
    split or the overlapped form, and only with head axes to order over."""
    if splits != 1 or overlap or not chain.rows[:-1]:
        return False
    tiles = proven_tiles(chain, rows, key_tile)   # (mean visited, guarded, all, blocks) or None
    return tiles is not None and tiles[0] < tiles[2]


def kv_split_choice(chain: OnlineChain, rows: int, key_tile: int, sms: int) -> tuple[int, str]:
    """(chunks, why) for split-KV: when the query blocks × heads (constant extents) are fewer
    than the GPU's `sms`, the key tiles of a block (the isl-proven mean when the mask skips
    some, a symbolic key extent at NOMINAL_LENGTH) are split into min(ceil(sms / blocks),
    tiles // MIN_CHUNK_TILES) chunks (floor: at most one wave of blocks); (1, "") when that is
    below 2 or the row and head extents are symbolic."""
    queries, heads = const_int(chain.rows[-1]), [const_int(h) for h in chain.rows[:-1]]
    if queries is None or any(h is None for h in heads):
        return 1, ""
    n_heads = 1
    for h in heads:
        assert h is not None
        n_heads *= h
    blocks = -(-queries // rows) * n_heads
    if blocks >= sms:
        return 1, ""
    found = proven_tiles(chain, rows, key_tile)
    if found is not None:
        tiles = found[0]
    else:
        keys = const_int(chain.keys)
        tiles = -(-(keys if keys is not None else NOMINAL_LENGTH) // key_tile)
    chunks = min(sms // blocks, int(tiles) // MIN_CHUNK_TILES)
    if chunks < 2:
        return 1, ""
    return chunks, (f"split-KV: {blocks} blocks of {rows} query rows would fill {blocks} of {sms} SMs, so the ~{tiles:.0f} key "
                    f"tiles of a block are split into {chunks} chunks (a grid axis), float32 partial O, max and sum "
                    f"per chunk, combined by a second kernel (at least {MIN_CHUNK_TILES} tiles a chunk)")


def step_args(rows: int, key_tile: int, warp_rows: int = 16, wgmma: bool = False, blocks_per_sm: int = 0,
              overlap: bool = False, kv_splits: int = 1, peel_guarded: bool = False,
              query_major: bool = False) -> dict[str, Any]:
    """The online_contraction_mma step's arguments for a tiling (defaults left out)."""
    args: dict[str, Any] = {"rows_per_block": rows, "key_tile": key_tile}
    if warp_rows != 16:
        args["warp_rows"] = warp_rows
    if wgmma:
        args["wgmma"] = True
    if blocks_per_sm:
        args["blocks_per_sm"] = blocks_per_sm
    if overlap:
        args["overlap"] = True
    if kv_splits > 1:
        args["kv_splits"] = kv_splits
    if peel_guarded:
        args["peel_guarded"] = True
    if query_major:
        args["query_major"] = True
    return args


def compiled(program: Program, args: dict[str, Any]) -> tuple[KernelResources, int] | str:
    """ptxas's report of the tensor-core kernel with this online_contraction_mma step's `args`
    (its worst kernel: split-KV adds a combine) and the dynamic shared memory of its launch, or
    why there is none (for the Hopper form also when ptxas serializes its wgmmas). Scheduled and
    compiled exactly as the build that takes the plan does (the pipeline's fixed tail, the
    module's name, the build's arch), so the compile cache holds the very binary the build asks
    for next (docs/cache.md); memoized per program."""
    key = "online_contraction/compiled/" + ",".join(f"{k}={v}" for k, v in sorted(args.items()))

    def compile_it() -> tuple[KernelResources, int] | str:
        plan = Plan((Step("online_contraction_mma", args),), "online_contraction_mma", "")
        timing = PassTiming()
        try:
            module = schedule_module(program.args, plan, name=program.name, dumper=None, timing=timing,
                                     lowered=program.module)
            kernel = compile_module(module, plan, "cuda", arch=program.compile_arch, options=(), dumper=None,
                                    timing=timing)
        except TeccError as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        found = list(kernel.resources.values())
        if len(found) != len(kernel.module.kernels) or not found:
            return (f"ptxas reported {len(found)} kernels for {len(kernel.module.kernels)} "
                    f"(log: {kernel.compile_log.strip()[:200]!r})")
        serialized = wgmma_serialized(kernel.compile_log) if args.get("wgmma") else None
        if serialized is not None:
            return f"ptxas serializes the wgmmas ({serialized[:120]})"
        worst = max(found, key=lambda r: (r.spill_stores + r.spill_loads, r.registers))
        return worst, dynamic_shared_bytes(kernel.module.kernels[0])
    return program.memo(key, compile_it)


# ---- the tensor-core forms ------------------------------------------------------------------------

class _TensorCoreForm(GraphStrategy):
    """What the wgmma and mma.sync forms share: the chain's facts, the fitted workload, the step."""

    form = ""
    compile_checked = True

    def tiling(self, point: Point) -> Tiling:
        return Tiling(self.form, int(point["rows_per_block"]), int(point["key_tile"]),
                      int(point.get("warp_rows", 16)) if self.form == "mma.sync" else 0, bool(point.get("overlap")))

    def workload(self, program: Program, point: Point) -> Workload:
        return self.workload_at(program, point, priced_facts(program))

    def order(self, program: Program, ranked: list[Any]) -> list[Any]:
        """The points in the order of their predictions at NOMINAL_LENGTH (chain_facts), as they
        were ranked before `workload` priced them at the per-kernel plans' sizes (priced_facts;
        the same where every extent is constant)."""
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts)
        if facts is priced_facts(program):
            return ranked

        def nominal(c: Any) -> tuple[float, float, int]:
            cost = predict(self.workload_at(program, c.point, facts), program.target)
            return cost.total, cost.terms.get("chain", 0.0), c.workload.threads
        return sorted(ranked, key=nominal)

    def workload_at(self, program: Program, point: Point, facts: ChainFacts) -> Workload:
        tiling = self.tiling(point)
        splits = int(point.get("kv_splits", 1))
        found = proven_tiles(facts.chain, tiling.rows, tiling.key_tile, facts.sizes)
        whole = -(-facts.keys // tiling.key_tile)
        tiles, guarded = (found[0], found[1]) if found is not None else (float(whole), 1.0 if facts.keys % tiling.key_tile else 0.0)
        launch = AttentionLaunch(blocks=-(-facts.queries // tiling.rows) * facts.heads * splits, tiles=tiles / splits,
                                 guarded=guarded / splits, heads=facts.heads, query_rows=facts.queries, keys=facts.keys,
                                 depth=facts.depth, columns=facts.columns, itemsize=facts.itemsize, kv_splits=splits)
        registers, smem, how = self.occupancy_inputs(program, facts, point, tiling, found)
        blocks_per_sm = occupancy(program.target, tiling.threads, -(-registers // 8) * 8, smem).blocks_per_sm
        return attention_workload(tiling, launch, registers, smem, max(blocks_per_sm, 1), program.target, facts.dtype,
                                  note=how, dropout=facts.chain.dropout is not None)

    def occupancy_inputs(self, program: Program, facts: ChainFacts, point: Point, tiling: Tiling,
                         found: tuple[float, float, float, int] | None) -> tuple[int, int, str]:
        """(registers, shared bytes, where they come from): nominal (the table)."""
        variant = tiling.warp_rows if self.form == "mma.sync" else int(point.get("blocks_per_sm", 0))
        stages = 3 if tiling.overlap else 2
        smem = shared_bytes(tiling.rows, tiling.key_tile, facts.depth, facts.columns, facts.itemsize, stages)
        regs = nominal_registers(self.form, facts.widest, tiling.rows, tiling.key_tile, variant, tiling.overlap)
        return regs, smem, f"{regs} registers (nominal, ptxas without a mask)"

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.online_contraction_mma(**point)

    def describe(self, point: Point) -> str:
        tiling = self.tiling(point)
        extra = [f"{tiling.rows // tiling.warp_rows} warps of {tiling.warp_rows} rows"] if self.form == "mma.sync" else []
        extra += [k if v is True else f"{k}={v}" for k, v in point.items()
                  if k not in ("rows_per_block", "key_tile", "warp_rows", "wgmma")]
        return f"{self.name}({tiling.rows}x{tiling.key_tile}{', ' if extra else ''}{', '.join(extra)})"


def _registers_words(resources: Mapping[str, KernelResources] | None, arch: str) -> str:
    if not resources:
        return ""
    worst = max(resources.values(), key=lambda r: r.registers)
    return f" ({arch}: {worst.registers} registers, no spills"


class OnlineContractionWgmma(_TensorCoreForm):
    """The Hopper form (module docstring)."""

    name = "online_contraction_wgmma"
    plan_name = "online_contraction_mma"   # the plan step's name, as plans recorded it
    priority = 2                           # ties: measured faster than mma.sync wherever they differed
    description = ("attention / softmax then a contraction in one kernel on Hopper tensor cores: wgmma for the "
                   "scores and for P·V with P from registers, Q/K/V in swizzled shared memory")
    form = "wgmma"

    def guard(self, program: Program) -> str | None:
        facts = chain_facts(program)
        if isinstance(facts, str):
            return facts
        if program.target.sm != WGMMA_ARCH:
            return f"wgmma is sm_90a only, the target is {program.target.arch}"
        return facts.not_tensor_cores or None

    def space(self, program: Program) -> list[Point]:
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts)
        sms = program.target.sm_count
        out = []
        for rows, key_tile, blocks, overlap in wgmma_tilings(facts.widest):
            splits = kv_split_choice(facts.chain, rows, key_tile, sms)[0]
            peel = not blocks and not overlap and self.peeled(program, facts, rows, key_tile, splits)
            query_major = launches_query_major(facts.chain, rows, key_tile, splits, overlap)
            out.append(step_args(rows, key_tile, wgmma=True, blocks_per_sm=blocks, overlap=overlap, kv_splits=splits,
                                 peel_guarded=peel, query_major=query_major))
        return out

    def skips_tiles(self, facts: ChainFacts, rows: int, key_tile: int) -> tuple[float, float, float, int] | None:
        found = proven_tiles(facts.chain, rows, key_tile, facts.program.sizes)
        return found if found is not None and found[0] < found[2] else None

    def compiled_occupancy(self, program: Program, facts: ChainFacts, rows: int, key_tile: int, splits: int,
                           peel: bool) -> tuple[int, int, int] | None:
        """(registers, shared bytes, blocks per SM) of the plain tiling's kernel as the build would
        compile it, or None when it does not compile cleanly."""
        found = compiled(program, step_args(rows, key_tile, wgmma=True, kv_splits=splits, peel_guarded=peel))
        if isinstance(found, str) or found[0].spill_stores or found[0].spill_loads:
            return None
        res, smem = found
        occ = occupancy(program.target, 2 * rows, res.registers, smem + res.shared_bytes)
        return res.registers, smem + res.shared_bytes, occ.blocks_per_sm

    def peeled(self, program: Program, facts: ChainFacts, rows: int, key_tile: int, splits: int) -> bool:
        """Whether a plain tiling under a mask that skips tiles takes the form with the guarded
        tiles in a loop of their own: when its registers keep the one-loop form below the blocks
        its shared memory allows and the peeled form fits more (ptxas allocates them differently:
        docs/attention.md)."""
        if self.skips_tiles(facts, rows, key_tile) is None:
            return False
        plain = self.compiled_occupancy(program, facts, rows, key_tile, splits, False)
        if plain is not None:
            regs, smem, per_sm = plain
            by_smem = dict(occupancy(program.target, 2 * rows, 8, smem).by)["shared memory"]
            if per_sm >= by_smem:
                return False   # registers do not limit it: peeling cannot fit more
        peeled = self.compiled_occupancy(program, facts, rows, key_tile, splits, True)
        return peeled is not None and (plain is None or peeled[2] > plain[2])

    def occupancy_inputs(self, program: Program, facts: ChainFacts, point: Point, tiling: Tiling,
                         found: tuple[float, float, float, int] | None) -> tuple[int, int, str]:
        """Under a mask that skips tiles, a plain tiling's compiled registers (the guard's decide
        the occupancy step); else the nominal ones."""
        plain = not point.get("blocks_per_sm") and not tiling.overlap
        if plain and found is not None and found[0] < found[2]:
            got = self.compiled_occupancy(program, facts, tiling.rows, tiling.key_tile,
                                          int(point.get("kv_splits", 1)), bool(point.get("peel_guarded")))
            if got is not None:
                regs, smem, per_sm = got
                return regs, smem, (f"{regs} registers compiled{' (guarded tiles peeled)' if point.get('peel_guarded') else ''}: "
                                    f"{per_sm} block{'s' if per_sm != 1 else ''}/SM")
        return super().occupancy_inputs(program, facts, point, tiling, found)

    def reason(self, program: Program, point: Point, resources: Mapping[str, KernelResources] | None = None) -> str:
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts)
        chain, tiling = facts.chain, self.tiling(point)
        rows, key_tile, blocks = tiling.rows, tiling.key_tile, int(point.get("blocks_per_sm", 0))
        arch = f"sm_{WGMMA_ARCH}a"
        splits, split_note = kv_split_choice(chain, rows, key_tile, program.target.sm_count)
        compiled_words = _registers_words(resources, arch)
        reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
                  f"{chain.l.name} (sum of exp) in one pass with a running max on Hopper tensor cores (wgmma for the "
                  f"scores and for P·V with P from registers, Q, K and V read from swizzled shared memory through "
                  f"descriptors), no score temporary of [{', '.join(map(str, chain.rows))}] x {chain.keys}; {rows} "
                  f"query rows per block ({rows // 64} warpgroups of 64 rows{f', {blocks} blocks per SM asked' if blocks else ''}"
                  f"), key tiles of {key_tile} through a {3 if tiling.overlap else 2}-stage cp.async ring"
                  f"{', the next tile scores and softmax while P·V is in flight' if tiling.overlap else ''}"
                  f"{', the guarded key tiles in a loop of their own after the whole ones (fewer registers here)' if point.get('peel_guarded') else ''}"
                  f"{compiled_words + ', wgmmas not serialized)' if compiled_words else ''}; "
                  "exp2 with log2(e) folded into the scale; "
                  f"{describe_skipping(program.args, rows, key_tile)}")
        if self.skips_tiles(facts, rows, key_tile) is not None:
            reason += ("; the mask skips key tiles (isl-proven counts): the tilings are costed at the blocks per SM "
                       "of their compiled kernels")
            got = None if blocks or tiling.overlap else self.compiled_occupancy(
                program, facts, rows, key_tile, splits, bool(point.get("peel_guarded")))
            if got is not None:
                peeled = ", guarded tiles peeled" if point.get("peel_guarded") else ""
                reason += f", {rows}x{key_tile} ({got[0]} registers{peeled}: {got[2]} block{'s' if got[2] != 1 else ''}/SM)"
        if split_note and splits > 1:
            reason += f"; {split_note}"
        if point.get("query_major"):
            reason += "; query blocks launched major over all heads (query_major: longest first over the whole launch)"
        return reason


class OnlineContractionMma(_TensorCoreForm):
    """The mma.sync form (module docstring)."""

    name = "online_contraction_mma"
    description = ("attention / softmax then a contraction in one kernel on tensor cores (mma.sync, K/V through a "
                   "cp.async ring, P kept in registers)")
    priority = 1
    form = "mma.sync"

    def guard(self, program: Program) -> str | None:
        facts = chain_facts(program)
        if isinstance(facts, str):
            return facts
        if facts.tcc is None:
            return facts.not_tensor_cores
        if program.target.sm < MMA_MIN_ARCH:
            return f"online_contraction_mma: {program.target.arch} has no mma.m16n8k16 / cp.async (sm_80 or newer)"
        return mma_sync_head_dims(facts.tcc)

    def space(self, program: Program) -> list[Point]:
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts)
        sms = program.target.sm_count
        return [step_args(rows, key_tile, warp_rows, kv_splits=kv_split_choice(facts.chain, rows, key_tile, sms)[0])
                for rows, key_tile, warp_rows in mma_tilings(facts.widest)]

    def reason(self, program: Program, point: Point, resources: Mapping[str, KernelResources] | None = None) -> str:
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts) and facts.tcc is not None
        chain, mma, tiling = facts.chain, facts.tcc, self.tiling(point)
        rows, key_tile, warp_rows = tiling.rows, tiling.key_tile, tiling.warp_rows
        arch = program.compile_arch
        compiled_words = _registers_words(resources, arch)
        hopper = OnlineContractionWgmma().guard(program)
        reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
                  f"{chain.l.name} (sum of exp) in one pass with a running max on tensor cores ({mma.qk_intrinsic} for "
                  f"the scores, {mma.pv_intrinsic} for P·V, P kept in registers), no score temporary of "
                  f"[{', '.join(map(str, chain.rows))}] x {chain.keys}; {rows} query rows per block "
                  f"({rows // warp_rows} warps of {warp_rows} rows), key tiles of {key_tile} through a 2-stage cp.async "
                  f"ring{compiled_words + ')' if compiled_words else ''}; exp2 with log2(e) folded into "
                  "the scale (ex2.approx.ftz: one MUFU.EX2, relative error ~2^-22, below P's rounding to 16 bits); "
                  f"{describe_skipping(program.args, rows, key_tile)}")
        if hopper is not None:
            reason += f"; mma.sync, not wgmma: {hopper}"
        splits, split_note = kv_split_choice(chain, rows, key_tile, program.target.sm_count)
        if split_note and splits > 1:
            reason += f"; {split_note}"
        return reason


class OnlineContractionSimt(GraphStrategy):
    """The SIMT form (module docstring)."""

    name = "online_contraction"
    description = ("attention / softmax then a contraction in one kernel on the SIMT lanes: 32 lanes per row, "
                   "a running max, key tiles of 32")

    def guard(self, program: Program) -> str | None:
        """The chain, with a constant column extent, that no tensor-core form takes on the target:
        the SIMT form is the chain's fallback (on an H200 it ran at 0.0017x cuDNN where the
        mma.sync form of the same chains ran at 0.59x, RESULTS.md "Attention on tensor cores",
        which its workload, an estimate fitted on nothing, does not capture)."""
        facts = chain_facts(program)
        if isinstance(facts, str):
            return facts
        if OnlineContractionMma().guard(program) is None or OnlineContractionWgmma().guard(program) is None:
            return "a tensor-core form takes the chain (the SIMT form is its fallback where none does)"
        return None

    def space(self, program: Program) -> list[Point]:
        return [{"threads": THREADS, "rows_per_block": ROWS_PER_BLOCK}]

    def workload(self, program: Program, point: Point) -> Workload:
        facts = priced_facts(program)
        return simt_workload(facts.queries, facts.keys, facts.heads, facts.depth, facts.columns, facts.itemsize,
                             int(point["threads"]), int(point["rows_per_block"]), score_wavefronts(facts.chain))

    def apply(self, sch: Any, program: Program, point: Point) -> None:
        sch.online_contraction(**point)

    def reason(self, program: Program, point: Point, resources: Any = None) -> str:
        facts = chain_facts(program)
        assert isinstance(facts, ChainFacts)
        chain = facts.chain
        reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
                  f"{chain.l.name} (sum of exp) in one pass with a running max, no score temporary of "
                  f"[{', '.join(map(str, chain.rows))}] x {chain.keys}; {point['rows_per_block']} rows per block, "
                  f"{point['threads']} lanes per row, key tiles of {point['threads']}")
        why_not = OnlineContractionMma().guard(program)
        if why_not:
            reason += f"; SIMT, not tensor cores: {why_not.removeprefix('online_contraction_mma: ')}"
            hopper = OnlineContractionWgmma().guard(program)
            if hopper is not None and program.target.sm == WGMMA_ARCH and hopper != why_not:
                reason += f" (wgmma: {hopper.removeprefix('online_contraction_mma: ')})"
        return reason


def score_wavefronts(chain: OnlineChain, lanes: int = THREADS) -> float:
    """The L1 wavefronts of one warp's scores of one SIMT key tile: lane tx evaluates s(r, j) at
    key j = tile·T + tx, so each read in s is one request whose lanes are `stride` bytes apart
    (the read's flattened coefficient of j times its element size): one wavefront while the
    lanes share 128-byte lines (a broadcast, a row read along j), up to one per lane when each
    key's row is a line of its own (K[.., j, d] at d·itemsize >= 128); a read under a reduction
    (the contraction over d) is issued once per step of it (a symbolic extent at NOMINAL_LENGTH)."""
    reduces = [n for n in walk(chain.score) if isinstance(n, Reduce)]
    total = 0.0
    for read in (n for n in walk(chain.score) if isinstance(n, TensorRead)):
        steps = 1
        for r in reduces:
            if any(n is read for n in walk(r.source)):
                for axis in r.axes:
                    steps *= const_int(axis.extent) or NOMINAL_LENGTH
        total += steps * _lines(read, chain.key, lanes)
    return total


def _lines(read: TensorRead, key: Var, lanes: int) -> int:
    """The 128-byte lines one warp request of `read` touches when its lanes take consecutive keys."""
    strides = element_strides(read.tensor)
    step = 0
    for index, stride in zip(read.indices, strides):
        found = affine_coefficients(index, [key]) if any(v is key for v in walk(index)) else (0,)
        s = const_int(stride)
        if found is None or (found[0] and s is None):
            return lanes
        step += found[0] * (s or 0)
    span = abs(step) * (read.dtype.bits // 8)
    return 1 if span == 0 else min(lanes, -(-lanes * span // 128))


register(OnlineContractionWgmma())
register(OnlineContractionMma())
register(OnlineContractionSimt())


__all__ = ["MIN_CHUNK_TILES", "NOMINAL_LENGTH", "NOMINAL_REGISTERS", "ChainFacts", "OnlineContractionMma",
           "OnlineContractionSimt", "OnlineContractionWgmma", "chain_facts", "compiled", "kv_split_choice",
           "launches_query_major", "mma_tilings", "nominal_registers", "proven_tiles", "score_wavefronts", "shared_bytes",
           "step_args",
           "wgmma_tilings"]
