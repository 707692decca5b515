"""Time the tilings of the tensor-core attention kernel against each other and SDPA flash.

    python benchmarks/attention_tilings.py [--s 1024] [--d 64] [--dtype float16] [--causal]

Builds the program of benchmarks/attention.py (same B = 16384 / S, H = 2048 / d) once per tiling
with an explicit plan `Step("online_contraction_mma", {rows_per_block, key_tile, warp_rows})`,
checks each against SDPA in float64 on a slice, and prints its time, TFLOP/s, ptxas registers
and the ratio to SDPA flash. The tiling build(plan="auto") picks is marked with *, so a faster
one says which order `mma_tilings` (tecc/compiler/strategies/online_contraction.py) should try.
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


def main() -> None:
    import torch

    import tecc as tc
    from tecc.compiler.plan import Plan, Step

    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--causal", action="store_true")
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
    for rows, key_tile, warp_rows in TILINGS:
        step = {"rows_per_block": rows, "key_tile": key_tile}
        if warp_rows != 16:
            step["warp_rows"] = warp_rows
        try:
            kern = tc.build(args, plan=Plan((Step("online_contraction_mma", step),), "tilings", ""))
        except Exception as exc:  # noqa: BLE001 - a tiling that does not build for this d
            print(f"  {rows:4d} x {key_tile:3d} warp_rows {warp_rows}: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=tdt)
        kern(q, k, v, o)
        torch.cuda.synchronize()
        err = float(((o[:1, :2].double() - ref).abs() / (1 + ref.abs())).max())
        t = time_call(lambda: kern(q, k, v, o), reps)
        (res,) = kern.resources.values()
        mark = "*" if step == chosen else " "
        print(f" {mark}{rows:4d} x {key_tile:3d} warp_rows {warp_rows}: {t * 1e6:9.1f} us {flops / t / 1e12:6.1f} TF/s "
              f"flash/tecc {flash / t:5.3f}  {res.registers} regs {res.spill_stores + res.spill_loads} B spills "
              f"rel err {err:.1e}")


if __name__ == "__main__":
    main()
