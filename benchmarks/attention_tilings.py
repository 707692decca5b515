"""Time the tilings of the tensor-core attention kernel against each other and SDPA flash.

    python benchmarks/attention_tilings.py [--s 1024] [--d 64] [--dtype float16] [--causal] [--wgmma] [--persistent 132]
                                           [--guard-every-tile] [--stages 3] [--peel] [--query-major]

Builds the program of benchmarks/attention.py (same B = 16384 / S, H = 2048 / d) once per tiling
with an explicit plan `Step("online_contraction_mma", {rows_per_block, key_tile, warp_rows})`,
checks each against SDPA in float64 on a slice, and prints its time, TFLOP/s, ptxas registers
and the ratio to SDPA flash. The tiling build(plan="auto") picks is marked with *, so a faster
one says where the cost model of the tilings (tecc/compiler/cost/attention.py) is off.
With --wgmma (an sm_90 GPU) the tilings are those of the Hopper form instead,
`{rows_per_block, key_tile, "wgmma": True, blocks_per_sm, overlap}` (WGMMA_TILINGS: 64 or 128 rows, one or two
warpgroups, 64- or 128-key tiles, with or without a blocks-per-SM request, overlapped or not); their
times are what cost/attention.py's table of block costs is fitted on.
`--persistent 132` adds, after each plain (not overlapped, no blocks-per-SM request) wgmma tiling, the
same tiling in the persistent form (132 blocks looping over the work items, longest first).
`--guard-every-tile` adds, after each tiling, the same tiling with the per-element mask guard on
every visited key tile (`guard_every_tile`): the difference over the extra guarded tiles is what
one guarded tile costs, measured rather than fitted (docs/attention.md, "What a guarded tile costs").
`--stages 3` adds, after each plain wgmma tiling, the same tiling with a 3-stage K/V ring (two
tiles of load latency hidden instead of one). `--peel` adds, after each plain wgmma tiling, the
same tiling with the guarded key tiles in a loop of their own (`peel_guarded`: what the planner
takes where it fits more blocks per SM, e.g. grouped causal d = 128). `--query-major` adds, after
each plain wgmma tiling, the same tiling launched query block major over all heads (`query_major`:
the longest block of every head first, the launch's tail on short blocks of all heads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.attention import attention_tensors, sdpa_times  # noqa: E402
from benchmarks.gemm import time_call  # noqa: E402

TILINGS = ((64, 64, 16), (128, 64, 16), (64, 32, 16), (128, 32, 32), (128, 64, 32), (64, 32, 32))
WGMMA_TILINGS = ((128, 128, 0, True), (128, 64, 0, True), (128, 64, 2, True), (64, 64, 0, True),
                 (128, 128, 0, False), (128, 64, 0, False), (128, 64, 2, False), (64, 64, 4, False))


def main() -> None:
    import torch

    import tecc as tc
    from tecc.compiler.plan import Plan, Step

    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--wgmma", action="store_true", help="the Hopper form's tilings (sm_90)")
    ap.add_argument("--persistent", type=int, default=0, metavar="BLOCKS",
                    help="with --wgmma: also each plain tiling as a persistent kernel of BLOCKS blocks (132 on an H200)")
    ap.add_argument("--guard-every-tile", action="store_true",
                    help="also each tiling with the per-element guard on every visited key tile (times the guard)")
    ap.add_argument("--stages", type=int, default=2, choices=(2, 3),
                    help="with --wgmma: 3 also times each plain tiling with a 3-stage K/V ring")
    ap.add_argument("--peel", action="store_true",
                    help="with --wgmma: also each plain tiling with the guarded key tiles in a loop of their own")
    ap.add_argument("--query-major", action="store_true",
                    help="with --wgmma: also each plain tiling launched query block major over all heads")
    opts = ap.parse_args()
    s, d, causal = opts.s, opts.d, opts.causal
    b, h = max(1, 16384 // s), 2048 // d
    args = attention_tensors(b, h, s, d, opts.dtype, causal)
    auto = tc.build(args)
    chosen = dict(auto.plan.steps[0].args) if auto.plan.strategy == "online_contraction_mma" else {}
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[opts.dtype]
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:1, :2].double(), k[:1, :2].double(),
                                                           v[:1, :2].double(), is_causal=causal)
    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    reps = max(5, min(30, int(5e12 / flops)))
    sdpa = sdpa_times(q, k, v, causal, reps)
    flash = sdpa.get("flash", float("nan"))
    times = ", ".join(f"{n} {t * 1e6:.1f} us" for n, t in sdpa.items())
    print(f"S={s} d={d} B={b} H={h} {opts.dtype} causal={causal}: SDPA {times}")
    points: list[tuple[int, int, int, dict[str, object]]] = []
    for rows, key_tile, warp_rows in TILINGS:
        step: dict[str, object] = {"rows_per_block": rows, "key_tile": key_tile}
        if warp_rows != 16:
            step["warp_rows"] = warp_rows
        points.append((rows, key_tile, warp_rows, step))
    if opts.wgmma:
        points = [(rows, key_tile, -blocks, {"rows_per_block": rows, "key_tile": key_tile, "wgmma": True,
                                              **({"blocks_per_sm": blocks} if blocks else {}),
                                              **({"overlap": True} if overlap else {})})
                  for rows, key_tile, blocks, overlap in WGMMA_TILINGS]
        if opts.persistent:
            points += [(rows, key_tile, 0, {"rows_per_block": rows, "key_tile": key_tile, "wgmma": True,
                                            "persistent": opts.persistent})
                       for rows, key_tile, blocks, overlap in WGMMA_TILINGS if not blocks and not overlap]
    if opts.wgmma and opts.stages != 2:
        points = [p for point in points for p in (point, *(
            [(*point[:3], {**point[3], "stages": opts.stages})]
            if not any(k in point[3] for k in ("overlap", "persistent", "blocks_per_sm")) else []))]
    if opts.wgmma and opts.peel:
        points = [p for point in points for p in (point, *(
            [(*point[:3], {**point[3], "peel_guarded": True})]
            if not any(k in point[3] for k in ("overlap", "blocks_per_sm")) else []))]
    if opts.wgmma and opts.query_major:
        points = [p for point in points for p in (point, *(
            [(*point[:3], {**point[3], "query_major": True})]
            if not any(k in point[3] for k in ("overlap", "blocks_per_sm", "persistent")) else []))]
    if opts.guard_every_tile:
        points = [p for point in points for p in (point, (*point[:3], {**point[3], "guard_every_tile": True}))]
    for rows, key_tile, warp_rows, step in points:
        try:
            kern = tc.build(args, plan=Plan((Step("online_contraction_mma", step),), "tilings", ""))
        except Exception as exc:  # noqa: BLE001 - a tiling that does not build for this d
            print(f"  {rows:4d} x {key_tile:3d} {_form(warp_rows)}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=tdt)
        kern(q, k, v, o)
        torch.cuda.synchronize()
        err = float(((o[:1, :2].double() - ref).abs() / (1 + ref.abs())).max())
        t = time_call(lambda: kern(q, k, v, o), reps)
        (res,) = kern.resources.values()
        mark = "*" if step == chosen else " "
        form = _form(warp_rows) + (" overlap" if step.get("overlap") else "") + \
            (f" persistent {step['persistent']}" if step.get("persistent") else "") + \
            (" every tile guarded" if step.get("guard_every_tile") else "") + \
            (f" {step['stages']} stages" if step.get("stages") else "") + \
            (" guarded tiles peeled" if step.get("peel_guarded") else "") + \
            (" query major" if step.get("query_major") else "")
        print(f" {mark}{rows:4d} x {key_tile:3d} {form}: {t * 1e6:9.1f} us {flops / t / 1e12:6.1f} TF/s "
              f"flash/tecc {flash / t:5.3f}  {res.registers} regs {res.spill_stores + res.spill_loads} B spills "
              f"rel err {err:.1e}")


def _form(warp_rows: int) -> str:
    """'warp_rows N' for the mma.sync tilings; 'wgmma' (and the blocks per SM asked) for the
    Hopper form's, whose points carry -blocks_per_sm there."""
    if warp_rows > 0:
        return f"warp_rows {warp_rows}"
    return "wgmma" + (f" {-warp_rows} blocks/SM" if warp_rows else "")


if __name__ == "__main__":
    main()
