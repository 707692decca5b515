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

When both contractions have float16/bfloat16 operands and constant head dims (16, 32, 64, 96,
128; 256 on sm_90's wgmma form only), `propose_mma` proposes the tensor-core kernel first (online_contraction_mma: mma.sync,
K/V tiles staged per block in shared memory): 64 query rows per block (4 warps, 16 rows each),
key tiles of 64 (of 32 when a head dim is 128, where the 64-key tile takes all 255 registers a
thread may hold: ~210 at 32 keys), the first tiling of `mma_tilings` that ptxas compiles for the
target's arch without spilling (its heuristics spill a value or two at d = 32 with 64 x 64, for
instance, where 128 x 64 fits in 120 registers). The SIMT plan's reason then
says why the tensor-core form does not apply (float32 operands, a symbolic or odd head dim ..).
On sm_90 `propose_wgmma` is asked before `propose_mma`: the Hopper form of the same kernel
(online_contraction_mma(wgmma=True): one warpgroup per 64 query rows, S = Q·Kᵀ and O += P·V as
wgmma with P from registers, Q/K/V in swizzled shared memory read through descriptors), the
first of `wgmma_tilings` that ptxas compiles for sm_90a without spills and without serializing
its wgmmas (C7515). Elsewhere, or when no tiling passes, the mma.sync plan is taken and its
reason says why the Hopper form was not.
No cost-model prediction ranks either against the unfused kernels: unfused, the chain writes and
re-reads an O(S²) score matrix, which no choice of tiles for the unfused kernels recovers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...codegen import KernelResources, default_arch, dynamic_shared_bytes
from ...ir import dtype as dt
from ...ir.errors import ScheduleError, TeccError
from ...ir.evaluate import evaluate_int
from ...ir.expr import Expr, Var, const_int, walk
from ...ir.target import target as target_info
from ...ir.tensor import Tensor
from ...passes.manager import PassTiming
from ...passes.rewrite.key_tiles import key_tile_bound, unmasked_tile_bound
from ...passes.rewrite.online_contraction import OnlineChain, online_chain
from ...passes.rewrite.online_contraction_mma import (
    describe_skipping,
    mma_sync_head_dims,
    online_contraction_mma,
    tensor_core_chain,
)
from ..cost.occupancy import occupancy
from ..pipeline import compile_module, schedule_module, wgmma_serialized
from ..plan import Plan, Step

THREADS = 32
ROWS_PER_BLOCK = 4
MMA_MIN_ARCH = 80  # mma.sync.m16n8k16, ldmatrix and cp.async: sm_80
WGMMA_ARCH = 90    # wgmma: sm_90a only


def _arch_number(target: Any) -> int | None:
    if isinstance(target, str) and target.startswith("sm_"):
        digits = "".join(ch for ch in target[3:] if ch.isdigit())
        return int(digits) if digits else None
    return None


def _why_not_mma(tensors: Sequence[Tensor], target: Any, sync: bool = True) -> str | None:
    """None when the tensor-core kernel applies (`sync`: its mma.sync form; else the wgmma one's
    head dims are enough), else the reason."""
    try:
        tcc = tensor_core_chain(online_chain(tensors))
    except ScheduleError as exc:
        return str(exc)
    arch = _arch_number(target)
    if arch is not None and arch < MMA_MIN_ARCH:
        return f"online_contraction_mma: {target} has no mma.m16n8k16 / cp.async (sm_80 or newer)"
    if sync:
        return mma_sync_head_dims(tcc)
    return None


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
    why_not = _why_not_mma(tensors, target)
    reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
              f"{chain.l.name} (sum of exp) in one pass with a running max, no score temporary of "
              f"[{', '.join(map(str, chain.rows))}] x {chain.keys}; {ROWS_PER_BLOCK} rows per block, {THREADS} lanes "
              f"per row, key tiles of {THREADS}")
    if why_not:
        reason += f"; SIMT, not tensor cores: {why_not.removeprefix('online_contraction_mma: ')}"
    plan = Plan((Step("online_contraction", {"threads": THREADS, "rows_per_block": ROWS_PER_BLOCK}),),
                "online_contraction", reason)
    return OnlineContractionChoice(plan, THREADS, ROWS_PER_BLOCK, reason)


def mma_tilings(widest: int) -> tuple[tuple[int, int, int], ...]:
    """(rows_per_block, key_tile, warp_rows) in the order they are tried for head dims up to
    `widest`, fastest measured first (benchmarks/attention_tilings.py on an H200, S = 4096, fp16,
    RESULTS.md "Attention on tensor cores"): up to d = 64, 128 rows of 4 warps with two m16 tiles
    each (each K/V fragment serves two mma) and 64-key tiles (1786 µs, against 1959 µs for 64 x 64
    with one m16 tile per warp, the old first; causal 960 against 1062); at d = 128, 64 x 64
    (1839 µs, against 2013 µs for 64 x 32), taking all 251 registers, with 64 x 32 next when
    ptxas spills it."""
    if widest > 64:
        return ((64, 64, 16), (64, 32, 16), (128, 32, 16))
    return ((128, 64, 32), (64, 64, 16), (128, 64, 16), (64, 32, 16))


def _compiled(tensors: Sequence[Tensor], args: dict[str, Any], arch: str, name: str | None = None,
              wgmma: bool = False) -> tuple[KernelResources, int] | str:
    """ptxas's report of the tensor-core kernel with this tiling (the online_contraction_mma step's
    `args`) and the dynamic shared memory of its launch, or why there is none (for the Hopper form
    also when ptxas serializes its wgmmas).

    The kernel is scheduled and compiled exactly as the build that takes the plan does
    (pipeline.schedule_module, then compile_module: the fixed tail of passes, the module's name,
    no extra options), so the compile cache holds the very binary the build asks for next and the
    check's compile is the build's only one (docs/cache.md)."""
    plan = Plan((Step("online_contraction_mma", args),), "online_contraction_mma", "")
    timing = PassTiming()
    try:
        module = schedule_module(list(tensors), plan, name=name, dumper=None, timing=timing)
        kernel = compile_module(module, plan, "cuda", arch=arch, options=(), dumper=None, timing=timing)
    except TeccError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    found = list(kernel.resources.values())
    if len(found) != len(kernel.module.kernels) or not found:
        return (f"ptxas reported {len(found)} kernels for {len(kernel.module.kernels)} "
                f"(log: {kernel.compile_log.strip()[:200]!r})")
    serialized = wgmma_serialized(kernel.compile_log) if wgmma else None
    if serialized is not None:
        return f"ptxas serializes the wgmmas ({serialized[:120]})"
    # split-KV adds a combine kernel: the plan is judged by its worst kernel (spills first)
    worst = max(found, key=lambda r: (r.spill_stores + r.spill_loads, r.registers))
    return worst, dynamic_shared_bytes(kernel.module.kernels[0])


def _ptxas(tensors: Sequence[Tensor], args: dict[str, Any], arch: str, name: str | None = None,
           wgmma: bool = False) -> KernelResources | str:
    """`_compiled`'s ptxas report alone."""
    found = _compiled(tensors, args, arch, name, wgmma)
    return found if isinstance(found, str) else found[0]


def _step_args(rows: int, key_tile: int, warp_rows: int = 16, wgmma: bool = False, blocks_per_sm: int = 0,
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


def wgmma_tilings(widest: int) -> tuple[tuple[int, int, int, bool], ...]:
    """(rows_per_block, key_tile, blocks_per_sm, overlap) of the Hopper form in the order they
    are tried for head dims up to `widest` (blocks_per_sm 0: no launch-bounds request), fastest
    measured first (benchmarks/attention_tilings.py --wgmma on an H200, S = 4096, fp16, not
    causal; RESULTS.md "Attention on Hopper"): the plain form beat the overlapped one (the next
    tile's scores and softmax while P·V is in flight, a 3-stage ring) at every tiling. Up to
    d = 64: two warpgroups × 128-key tiles 1235 µs (overlapped 128 × 64, the first tried before,
    1415 µs), then 64 × 64 asking for 4 blocks per SM 1319 µs, 128 × 64 1340 µs; at d = 128:
    128 × 64 1059 µs (overlapped 128 × 128 1285 µs), then 128 × 128 1165 µs. The overlapped
    tilings stay as later choices. d = 256 (not measured yet): 64-key tiles only (O is 128 float32
    registers per thread, and 128-key K/V tiles would not fit shared memory), two warpgroups
    first; d = 96 takes d = 128's order."""
    if widest > 128:
        return ((128, 64, 0, False), (64, 64, 0, False))
    if widest > 64:
        return ((128, 64, 0, False), (128, 128, 0, False), (64, 64, 0, False), (128, 64, 0, True),
                (128, 128, 0, True))
    return ((128, 128, 0, False), (64, 64, 4, False), (128, 64, 2, False), (128, 64, 2, True), (128, 128, 0, True))


# ---- a cost per block for the Hopper tilings, fitted on H200 timings ------------------------------

# (F, t, m) per (head-dim class, rows, key tile, blocks per SM): SM-microseconds of one block
# (a launch's time = Σ block costs / 132 SMs; with k blocks resident per SM a block's wall time is
# k times its cost), F fixed per block (Q load, ring fill, epilogue), t per key tile visited, m
# more per key tile visited with the per-element guard (the diagonal tiles of a mask). The blocks
# per SM are the occupancy ptxas's registers and the tiling's shared memory give
# (cost.occupancy: 256 threads at <= 128 registers are 2 blocks per SM): a tiling is costed with
# the entry of the occupancy its compiled kernel has, and not costed when there is none.
# Fitted on benchmarks/attention_tilings.py --wgmma / attention.py (H200, fp16; B = 16384 / S,
# H = 2048 / d, so 2048 blocks of 128 rows at d = 128 and 4096 at d = 64 for S = 4k and 8k), a
# block's cost taken as time · 132 / blocks:
#   d = 128, 128 x 64, 2 blocks/SM (127-128 registers): not causal, Sk = 1k / 2k / 4k / 8k 293.6 /
#       526.5 / 1001.8 / 1947.9 us (16 .. 128 tiles; attention_program, B = 2, H = 16 at 8k):
#       57 us fixed + 236.5 us per 1024 keys over the 2048 blocks -> F, t; m unmeasured at this
#       occupancy: 0.2·t, the guard's share of a tile's SASS (~80 of ~420 instructions per thread,
#       docs/attention.md "What a guarded tile costs")
#   d = 128, 128 x 64, 1 block/SM (133 registers, the causal kernel before the limit guard): 8k
#       causal 1394.3 us (65 tiles, 2 guarded, on average) with F as above and m = 0.2·t -> t:
#       1.38x the 2-blocks/SM rate (half the warps to hide the wgmma and load latency)
#   d = 128, 128 x 128, 1 block/SM (170-182 registers): 4k 1165, 8k 2188.4 (32, 64 tiles) -> F, t;
#       8k causal 1202.5 (32.5 tiles, 1 guarded) -> m
#   d = 64,  128 x 128, 2 blocks/SM (128 registers): 4k 1235, 8k 2314.9; 8k causal 1287.0
#   d = 64,  128 x 64, 2 blocks/SM (95-96 registers): 4k 1340, 8k 2580.5; 8k causal 1460.8
# So at d = 128 under a mask that skips tiles 128 x 64 wins when its kernel fits 2 blocks per SM
# (predicted 1024 against 1202 us at causal 8k) and 128 x 128 when it does not (a guard or grouped
# heads' addressing taking 128 x 64 past 128 registers: 1394 against 1202); without a mask
# 128 x 64 stays first. With the launch's waves and tail modelled, 128 x 128's causal time has no
# excess at all (docs/attention.md, "What a guarded tile costs").
WGMMA_BLOCK_COST: dict[tuple[int, int, int, int], tuple[float, float, float]] = {
    (128, 128, 64, 2): (3.674, 0.9526, 0.1905),
    (128, 128, 64, 1): (3.674, 1.3180, 0.2636),
    (128, 128, 128, 1): (9.15, 2.061, 1.37),
    (64, 128, 128, 2): (5.00, 1.088, 1.14),
    (64, 128, 64, 2): (3.24, 0.624, 1.64),
}
NOMINAL_LENGTH = 8192   # a symbolic row or key extent is costed at this length (the fit's)


def _head_dim_class(widest: int) -> int:
    return 64 if widest <= 64 else 128 if widest <= 128 else widest


def has_block_cost(widest: int, rows: int, key_tile: int) -> bool:
    """Whether WGMMA_BLOCK_COST has a fit for the tiling at some occupancy."""
    return any(k[:3] == (_head_dim_class(widest), rows, key_tile) for k in WGMMA_BLOCK_COST)


def block_cost(widest: int, rows: int, key_tile: int, tiles: float, guarded: float, blocks_per_sm: int
               ) -> float | None:
    """The fitted cost of one block (SM-µs on an H200: the launch takes Σ costs / 132) of a kernel
    resident `blocks_per_sm` to an SM, visiting `tiles` key tiles of which `guarded` carry the
    per-element guard; None without a fit for the tiling at that occupancy."""
    fit = WGMMA_BLOCK_COST.get((_head_dim_class(widest), rows, key_tile, blocks_per_sm))
    if fit is None:
        return None
    fixed, per_tile, per_guarded = fit
    return fixed + per_tile * tiles + per_guarded * guarded


def proven_tiles(chain: OnlineChain, rows: int, key_tile: int) -> tuple[float, float, float, int] | None:
    """(mean visited key tiles per block, mean guarded ones, all tiles of a row, blocks) of the
    blocks of `rows` query rows, from the isl-proven bounds (key_tiles.py) evaluated at the
    program's sizes (a symbolic extent at NOMINAL_LENGTH); None when the mask gives no proven
    bound (every block visits every tile: nothing is skipped)."""
    block = Var("query_block", dt.int32)
    bound = key_tile_bound(chain, block, rows, key_tile)
    if bound is None:
        return None
    unmasked = unmasked_tile_bound(chain, block, rows, key_tile)
    sizes: list[Expr] = [chain.rows[-1], chain.keys, bound[0]] + ([unmasked] if unmasked is not None else [])
    env: dict[Var, int] = {v: NOMINAL_LENGTH for e in sizes for v in walk(e) if isinstance(v, Var) and v is not block}
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


def masked_tiling_order(chain: OnlineChain, widest: int, tilings: Sequence[tuple[int, int, int, bool]],
                        occupancy_of: Callable[[int, int], tuple[int, int] | None]
                        ) -> tuple[tuple[tuple[int, int, int, bool], ...], str]:
    """`tilings` with those that have a fitted cost (WGMMA_BLOCK_COST; plain form, no blocks-per-SM
    request) reordered among their own places by predicted time, when the isl-proven tile counts
    show the mask skips tiles (mean visited < all); else unchanged. `occupancy_of(rows, key_tile)`
    is (registers, blocks per SM) of the plain tiling's compiled kernel (None: it does not compile
    cleanly), which picks the fit's entry. With the note for the plan."""
    candidates: list[tuple[int, tuple[float, float, float, int]]] = []
    for at, (rows, key_tile, blocks, overlap) in enumerate(tilings):
        if blocks or overlap or not has_block_cost(widest, rows, key_tile):
            continue
        found = proven_tiles(chain, rows, key_tile)
        if found is None:
            return tuple(tilings), ""
        candidates.append((at, found))
    if len(candidates) < 2 or not any(mean < whole for _, (mean, _, whole, _) in candidates):
        return tuple(tilings), ""
    costed: list[tuple[float, int]] = []
    said: list[str] = []
    for at, (mean, guarded, whole, n_blocks) in candidates:
        rows, key_tile = tilings[at][:2]
        occ = occupancy_of(rows, key_tile)
        cost = None if occ is None else block_cost(widest, rows, key_tile, mean, guarded, occ[1])
        if occ is None or cost is None:
            said.append(f"{rows}x{key_tile} not costed ({'no clean compile' if occ is None else f'no fit at {occ[1]} blocks/SM'})")
            continue
        costed.append((cost * n_blocks, at))
        said.append(f"{rows}x{key_tile} ({occ[0]} registers: {occ[1]} block{'s' if occ[1] != 1 else ''}/SM) "
                    f"{mean:.1f} of {whole:.0f} tiles ({guarded:.1f} guarded) per block, {cost * n_blocks:.0f}")
    if len(costed) < 2:
        return tuple(tilings), ""
    places = sorted(at for _, at in costed)
    ranked = [at for _, at in sorted(costed)]
    order = list(tilings)
    for place, at in zip(places, ranked):
        order[place] = tilings[at]
    note = ("the mask skips key tiles (isl-proven counts), so the tilings are ranked by the fitted cost per block "
            "F + t·tiles + m·guarded tiles at the blocks per SM of the compiled kernel (WGMMA_BLOCK_COST, H200; "
            "SM-µs summed over one head's query blocks): " + "; ".join(said))
    return tuple(order), note


# ---- split-KV for few query rows over many keys (decoding) --------------------------------------

MIN_CHUNK_TILES = 4   # a key chunk of fewer tiles spends more on its prologue, ring fill and partials


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


def decode_first(tilings: Sequence[tuple[int, int, int, bool]], queries: int | None
                 ) -> tuple[tuple[int, int, int, bool], ...]:
    """With at most 64 query rows, the one-warpgroup (64-row) tilings first: a second warpgroup
    would only compute rows past the end."""
    if queries is None or queries > 64:
        return tuple(tilings)
    return tuple(sorted(tilings, key=lambda t: t[0] > 64))


def _why_not_wgmma(tensors: Sequence[Tensor], target: Any) -> str | None:
    """None when the Hopper form may be tried for `target`, else the reason."""
    arch = _arch_number(target if _arch_number(target) is not None else default_arch())
    if arch != WGMMA_ARCH:
        return f"wgmma is sm_90a only, the target is sm_{arch}"
    return _why_not_mma(tensors, target, sync=False)


def propose_wgmma(tensors: Sequence[Tensor], target: Any = None,
                  name: str | None = None) -> OnlineContractionChoice | None:
    """The Hopper (wgmma) plan for the chain `tensors` on sm_90, or None (the target is not
    sm_90, the chain does not fit tensor cores, or no tiling of `wgmma_tilings` compiles without
    spills or serialized wgmmas: `propose_mma` then says why)."""
    found = _wgmma_choice(tensors, target, name)
    return found if isinstance(found, OnlineContractionChoice) else None


def _wgmma_choice(tensors: Sequence[Tensor], target: Any, name: str | None = None) -> OnlineContractionChoice | str:
    why_not = _why_not_wgmma(tensors, target)
    if why_not is not None:
        return why_not
    chain = online_chain(tensors)
    mma = tensor_core_chain(chain)
    widest = max(mma.depth, const_int(chain.columns) or 0)
    arch = f"sm_{WGMMA_ARCH}"
    checked: list[str] = []
    sms = target_info(arch).sm_count

    peeled: set[tuple[int, int]] = set()   # plain tilings whose guarded tiles fit more blocks/SM in a loop of their own

    def occupancy_of(rows: int, key_tile: int) -> tuple[int, int] | None:
        """(registers, blocks per SM) of the plain tiling's kernel as the build would compile it;
        when registers keep it below the blocks its shared memory allows, the form with the
        guarded tiles peeled into their own loop is compiled too (ptxas allocates it differently:
        docs/attention.md) and taken when it fits more."""
        splits = kv_split_choice(chain, rows, key_tile, sms)[0]
        best: tuple[int, int] | None = None
        for peel in (False, True):
            found = _compiled(tensors, _step_args(rows, key_tile, wgmma=True, kv_splits=splits, peel_guarded=peel),
                              arch, name, wgmma=True)
            if isinstance(found, str) or found[0].spill_stores or found[0].spill_loads:
                continue
            res, smem = found
            occ = occupancy(target_info(arch), 2 * rows, res.registers, smem + res.shared_bytes)
            if best is None or occ.blocks_per_sm > best[1]:
                best = (res.registers, occ.blocks_per_sm)
                if peel:
                    peeled.add((rows, key_tile))
            if best is not None and best[1] >= dict(occ.by)["shared memory"]:
                break   # registers do not limit it: peeling cannot fit more
        return best

    tilings, masked_note = masked_tiling_order(chain, widest, wgmma_tilings(widest), occupancy_of)
    tilings = decode_first(tilings, const_int(chain.rows[-1]))
    for rows, key_tile, blocks, overlap in tilings:
        label = f"{rows}x{key_tile}" + (f" ({blocks} blocks/SM)" if blocks else "") + (" overlapped" if overlap else "")
        splits, split_note = kv_split_choice(chain, rows, key_tile, sms)
        peel = not blocks and not overlap and (rows, key_tile) in peeled
        query_major = launches_query_major(chain, rows, key_tile, splits, overlap)
        res = _ptxas(tensors, _step_args(rows, key_tile, wgmma=True, blocks_per_sm=blocks, overlap=overlap,
                                         kv_splits=splits, peel_guarded=peel, query_major=query_major), arch,
                     name, wgmma=True)
        if isinstance(res, str):
            checked.append(f"{label}: {res}")
            continue
        if res.spill_stores or res.spill_loads:
            checked.append(f"{label}: {res.registers} registers, spills")
            continue
        break
    else:
        return "no tiling compiles without spills or serialized wgmmas: " + "; ".join(checked)
    passed_over = f" (passed over: {'; '.join(checked)})" if checked else ""
    reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
              f"{chain.l.name} (sum of exp) in one pass with a running max on Hopper tensor cores (wgmma for the "
              f"scores and for P·V with P from registers, Q, K and V read from swizzled shared memory through "
              f"descriptors), no score temporary of [{', '.join(map(str, chain.rows))}] x {chain.keys}; {rows} "
              f"query rows per block ({rows // 64} warpgroups of 64 rows{f', {blocks} blocks per SM asked' if blocks else ''}"
              f"), key tiles of {key_tile} through a {3 if overlap else 2}-stage cp.async ring"
              f"{', the next tile scores and softmax while P·V is in flight' if overlap else ''}"
              f"{', the guarded key tiles in a loop of their own after the whole ones (fewer registers here)' if peel else ''}"
              f" ({arch}a: {res.registers} registers, no spills, wgmmas not serialized{passed_over}); "
              "exp2 with log2(e) folded into the scale; "
              f"{describe_skipping(tensors, rows, key_tile)}"
              f"{f'; {masked_note}' if masked_note else ''}")
    if split_note:
        reason += f"; {split_note}"
    if query_major:
        reason += "; query blocks launched major over all heads (query_major: longest first over the whole launch)"
    plan = Plan((Step("online_contraction_mma", _step_args(rows, key_tile, wgmma=True, blocks_per_sm=blocks,
                                                           overlap=overlap, kv_splits=splits, peel_guarded=peel,
                                                           query_major=query_major)),),
                "online_contraction_mma", reason)
    return OnlineContractionChoice(plan, 2 * rows, rows, reason)


def propose_mma(tensors: Sequence[Tensor], target: Any = None,
                name: str | None = None) -> OnlineContractionChoice | None:
    """The tensor-core plan for the chain `tensors`, or None when the chain is not one or its
    contractions do not fit mma (then `propose` gives the SIMT plan and says why). ptxas decides
    the registers, so the first tiling of `mma_tilings` that compiles for the target's arch
    (NVRTC, no GPU needed; cached for the build) without spilling is taken."""
    if _why_not_mma(tensors, target) is not None:
        return None
    chain = online_chain(tensors)
    mma = tensor_core_chain(chain)
    widest = max(mma.depth, const_int(chain.columns) or 0)
    arch = target if _arch_number(target) is not None else default_arch()
    checked: list[str] = []
    sms = target_info(arch).sm_count
    for rows, key_tile, warp_rows in mma_tilings(widest):
        # the kernel the build compiles: with its key splits, which change its registers
        splits, split_note = kv_split_choice(chain, rows, key_tile, sms)
        res = _ptxas(tensors, _step_args(rows, key_tile, warp_rows, kv_splits=splits), arch, name)
        if isinstance(res, str):
            checked.append(f"{rows}x{key_tile}/{warp_rows}: {res}")
            continue
        if res.spill_stores or res.spill_loads:
            checked.append(f"{rows}x{key_tile}/{warp_rows}: {res.registers} registers, spills")
            continue
        break
    else:
        return None
    passed_over = f" (passed over: {'; '.join(checked)})" if checked else ""
    hopper = _wgmma_choice(tensors, target, name)
    not_wgmma = "" if not isinstance(hopper, str) else f"; mma.sync, not wgmma: {hopper}"
    reason = (f"{chain.output.name}: a contraction over the axis of the row statistics {chain.m.name} (max) and "
              f"{chain.l.name} (sum of exp) in one pass with a running max on tensor cores ({mma.qk_intrinsic} for "
              f"the scores, {mma.pv_intrinsic} for P·V, P kept in registers), no score temporary of "
              f"[{', '.join(map(str, chain.rows))}] x {chain.keys}; {rows} query rows per block "
              f"({rows // warp_rows} warps of {warp_rows} rows), key tiles of {key_tile} through a 2-stage cp.async ring ({arch}: "
              f"{res.registers} registers, no spills{passed_over}); exp2 with log2(e) folded into "
              "the scale (ex2.approx.ftz: one MUFU.EX2, relative error ~2^-22, below P's rounding to 16 bits); "
              f"{describe_skipping(tensors, rows, key_tile)}{not_wgmma}")
    if split_note:
        reason += f"; {split_note}"
    plan = Plan((Step("online_contraction_mma", _step_args(rows, key_tile, warp_rows, kv_splits=splits)),),
                "online_contraction_mma", reason)
    return OnlineContractionChoice(plan, 32 * (rows // warp_rows), rows, reason)


__all__ = ["MIN_CHUNK_TILES", "NOMINAL_LENGTH", "decode_first", "kv_split_choice", "OnlineContractionChoice", "WGMMA_BLOCK_COST", "block_cost", "has_block_cost", "masked_tiling_order",
           "mma_tilings", "proven_tiles", "propose", "propose_mma", "propose_wgmma", "wgmma_tilings"]
