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
from typing import Any, Sequence

from ...codegen import KernelResources, default_arch
from ...ir.errors import ScheduleError, TeccError
from ...ir.expr import const_int
from ...ir.tensor import Tensor
from ...passes.rewrite.online_contraction import online_chain
from ...passes.manager import PassTiming
from ...passes.rewrite.online_contraction_mma import (
    describe_skipping,
    mma_sync_head_dims,
    online_contraction_mma,
    tensor_core_chain,
)
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


def _ptxas(tensors: Sequence[Tensor], args: dict[str, Any], arch: str, name: str | None = None,
           wgmma: bool = False) -> KernelResources | str:
    """ptxas's report of the tensor-core kernel with this tiling (the online_contraction_mma step's
    `args`), or why there is none (for the Hopper form also when ptxas serializes its wgmmas).

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
    if len(found) != 1:
        return f"ptxas reported {len(found)} kernels for one (log: {kernel.compile_log.strip()[:200]!r})"
    serialized = wgmma_serialized(kernel.compile_log) if wgmma else None
    if serialized is not None:
        return f"ptxas serializes the wgmmas ({serialized[:120]})"
    return found[0]


def _step_args(rows: int, key_tile: int, warp_rows: int = 16, wgmma: bool = False, blocks_per_sm: int = 0,
               overlap: bool = False) -> dict[str, Any]:
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
    for rows, key_tile, blocks, overlap in wgmma_tilings(widest):
        label = f"{rows}x{key_tile}" + (f" ({blocks} blocks/SM)" if blocks else "") + (" overlapped" if overlap else "")
        res = _ptxas(tensors, _step_args(rows, key_tile, wgmma=True, blocks_per_sm=blocks, overlap=overlap), arch,
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
              f"{', the next tile scores and softmax while P·V is in flight' if overlap else ''} ({arch}a: {res.registers} registers, no spills, wgmmas not serialized{passed_over}); "
              "exp2 with log2(e) folded into the scale; "
              f"{describe_skipping(tensors, rows, key_tile)}")
    plan = Plan((Step("online_contraction_mma", _step_args(rows, key_tile, wgmma=True, blocks_per_sm=blocks,
                                                           overlap=overlap)),), "online_contraction_mma", reason)
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
    for rows, key_tile, warp_rows in mma_tilings(widest):
        res = _ptxas(tensors, _step_args(rows, key_tile, warp_rows), arch, name)
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
    plan = Plan((Step("online_contraction_mma", _step_args(rows, key_tile, warp_rows)),),
                "online_contraction_mma", reason)
    return OnlineContractionChoice(plan, 32 * (rows // warp_rows), rows, reason)


__all__ = ["OnlineContractionChoice", "mma_tilings", "propose", "propose_mma", "propose_wgmma", "wgmma_tilings"]
