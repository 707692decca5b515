"""Attention written as tensor expressions vs torch's scaled_dot_product_attention (issue 15).

    python benchmarks/attention.py [--quick] [--dtype float16|bfloat16] [--gqa] [--dims 96 256] [--persistent 132]
                                   [--plain-order] [--stages 3] [--decode [--kv-splits 8 16 32]] [--out DIR]

Each row builds the program users write (scores as a float32 contraction of Q and K, a causal
`where` when asked, row max, exp, row sum, the contraction with V divided by the sum, cast back to
the input dtype) with `tc.build(args)` (plan chosen by build: the online-contraction rewrite when
its structure matches), checks it against torch in float64 on fresh random inputs with a
NaN-poisoned output, and times it with CUDA events in the same process as SDPA's flash and cuDNN
backends (each where torch offers it for the shape). The ratio is against the fastest of them.
B·H fills the GPU as FlashAttention's benchmarks do: 16k tokens per batch (B = 16384 / S) and
2048 / d heads (rounded down). `--gqa`: 32 query heads over 8 K/V heads (K[b, h // 4, j, d]), d = 128.
`--dims`: the head dims to run (e.g. `--dims 96 256`: the wgmma form's 96 and 256). `--persistent 132`:
the planned wgmma kernel in its persistent form (132 blocks looping over the work items). `--stages 3`:
the planned wgmma kernel with a 3-stage K/V ring (plain loop only). Each
causal row is followed by its time over the non-causal one's. `--decode`: 1, 4 and 16 query rows
over 4k, 16k and 64k cached keys (bottom-right causal mask), the planned kernel (split-KV) and
the same plan unsplit against SDPA's flash, cuDNN and memory-efficient backends.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.gemm import time_call  # noqa: E402


def attention_tensors(b: int, h: int, s: int, d: int, dtype: str, causal: bool, groups: int = 1) -> list[Any]:
    """The program users write; `groups` query heads share one K/V head (K[b, h // groups, j, d])."""
    return attention_program(b, h, s, s, d, dtype, groups, 0 if causal else None)


def decode_tensors(b: int, h: int, sq: int, sk: int, d: int, dtype: str, groups: int) -> list[Any]:
    """Decoding: `sq` new query rows over `sk` cached keys, query i seeing keys j <= i + sk - sq
    (the bottom-right causal mask; every key when sq = 1), `groups` query heads per K/V head."""
    return attention_program(b, h, sq, sk, d, dtype, groups, sk - sq if sq > 1 else None)


def attention_program(b: int, h: int, sq: int, sk: int, d: int, dtype: str, groups: int,
                      offset: int | None) -> list[Any]:
    """Attention of `sq` query rows over `sk` keys as tensor expressions; with `offset`, query i
    sees keys j <= i + offset (0: causal), without it every key."""
    import tecc as tc

    Q = tc.placeholder((b, h, sq, d), dtype, name="Q")
    K = tc.placeholder((b, h // groups, sk, d), dtype, name="K")
    V = tc.placeholder((b, h // groups, sk, d), dtype, name="V")
    r = tc.reduce_axis(d, name="d")
    j1, j2, j3 = (tc.reduce_axis(sk, name=n) for n in ("j1", "j2", "j3"))
    scale = 1.0 / math.sqrt(d)

    def score(bb: Any, hh: Any, i: Any, j: Any) -> Any:
        x = tc.sum(tc.cast(Q[bb, hh, i, r], "float32") * tc.cast(K[bb, hh // groups, j, r], "float32"), axis=r) * scale
        if offset is None:
            return x
        return tc.where(j <= (i + offset if offset else i), x, -math.inf)

    S = tc.compute((b, h, sq, sk), score, name="S")
    m = tc.compute((b, h, sq), lambda bb, hh, i: tc.max(S[bb, hh, i, j1], axis=j1), name="m")
    e = tc.compute((b, h, sq, sk), lambda bb, hh, i, j: tc.exp(S[bb, hh, i, j] - m[bb, hh, i]), name="e")
    l = tc.compute((b, h, sq), lambda bb, hh, i: tc.sum(e[bb, hh, i, j2], axis=j2), name="l")
    O = tc.compute((b, h, sq, d), lambda bb, hh, i, c: tc.cast(
        tc.sum(e[bb, hh, i, j3] * tc.cast(V[bb, hh // groups, j3, c], "float32"), axis=j3) / l[bb, hh, i], dtype),
        name="O")
    return [Q, K, V, O]


def run_decode(sq: int, sk: int, d: int, dtype: str, b: int, h: int, groups: int,
               other_splits: tuple[int, ...] = ()) -> dict[str, Any]:
    """The planned kernel (split-KV when the planner takes it), the same plan without the split,
    and SDPA's backends (bottom-right causal bias when sq > 1, K/V expanded to the query heads
    for the backends without enable_gqa) on the same inputs; checked in float64."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import tecc as tc
    from tecc.compiler.plan import Plan, Step

    args = decode_tensors(b, h, sq, sk, d, dtype, groups)
    kern = tc.build(args)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    q = torch.randn(b, h, sq, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(b, h // groups, sk, d, device="cuda", dtype=tdt) for _ in range(2))
    kx, vx = (x.repeat_interleave(groups, dim=1) for x in (k, v))
    mask = None
    if sq > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(sq, sk)
    o = torch.full((b, h, sq, d), float("nan"), device="cuda", dtype=tdt)
    kern(q, k, v, o)
    torch.cuda.synchronize()
    ref = sdpa(q.double(), kx.double(), vx.double(), attn_mask=mask)
    err = float(((o.double() - ref).abs() / (1 + ref.abs())).max())
    reps = 50
    row: dict[str, Any] = {"Sq": sq, "Sk": sk, "d": d, "B": b, "H": h, "H_kv": h // groups, "dtype": dtype,
                           "rel_err": err, "plan": _plan_label(kern.plan), "tecc_us": time_call(lambda: kern(q, k, v, o), reps) * 1e6}
    step = dict(kern.plan.steps[0].args) if kern.plan.strategy == "online_contraction_mma" else {}
    if step:
        for splits in (1, *other_splits):
            if splits == step.get("kv_splits", 1):
                continue
            other = {key: val for key, val in step.items() if key != "kv_splits"}
            if splits > 1:
                other["kv_splits"] = splits
            alt = tc.build(args, plan=Plan((Step("online_contraction_mma", other),), "other split", ""))
            alt(q, k, v, o)
            torch.cuda.synchronize()
            alt_err = float(((o.double() - ref).abs() / (1 + ref.abs())).max())
            key = "tecc_no_split_us" if splits == 1 else f"tecc_{splits}_splits_us"
            row[key] = time_call(lambda: alt(q, k, v, o), reps) * 1e6
            if splits > 1:
                print(f"  kv_splits={splits}: {row[key]:.1f} us (rel err {alt_err:.1e})", flush=True)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                sdpa(q, kx, vx, attn_mask=mask)
                torch.cuda.synchronize()
                row[f"sdpa_{name}_us"] = time_call(lambda: sdpa(q, kx, vx, attn_mask=mask), reps) * 1e6
        except Exception as exc:  # noqa: BLE001 - a backend torch does not offer for this shape
            print(f"  SDPA {name} unavailable: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    refs = [t for n, t in row.items() if n.startswith("sdpa_")]
    row["ratio"] = min(refs) / row["tecc_us"] if refs else float("nan")
    return row


def decode_main(dtype: str, out: str | None, other_splits: tuple[int, ...] = ()) -> None:
    """--decode: Sq in {1, 4, 16} over Sk in {4k, 16k, 64k}, B = 1, H = 32 over 8 K/V heads, d = 128,
    and B = 2, H = 16, d = 64 without grouping."""
    rows = []
    print(f"{'Sq':>3} {'Sk':>6} {'d':>4} {'B':>2} {'H':>6} {'tecc us':>9} {'no split':>9} {'flash':>8} {'cudnn':>8} "
          f"{'effic.':>8} {'ratio':>6} {'rel err':>8}  plan", flush=True)
    for d, b, h, groups in ((128, 1, 32, 4), (64, 2, 16, 1)):
        for sk in (4096, 16384, 65536):
            for sq in (1, 4, 16):
                try:
                    row = run_decode(sq, sk, d, dtype, b, h, groups, other_splits)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row = {"Sq": sq, "Sk": sk, "d": d, "error": f"{type(exc).__name__}: {exc}"[:400]}
                    print(row, flush=True)
                    rows.append(row)
                    continue
                rows.append(row)
                nan = float("nan")
                print(f"{sq:3d} {sk:6d} {d:4d} {b:2d} {h:3d}/{h // groups:<2d} {row['tecc_us']:9.1f} "
                      f"{row.get('tecc_no_split_us', nan):9.1f} {row.get('sdpa_flash_us', nan):8.1f} "
                      f"{row.get('sdpa_cudnn_us', nan):8.1f} {row.get('sdpa_efficient_us', nan):8.1f} "
                      f"{row['ratio']:6.3f} {row['rel_err']:8.1e}  {row['plan']}", flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r and r["ratio"] == r["ratio"]]
    if ratios:
        print(f"geometric mean ratio vs the fastest SDPA backend: "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f} over {len(ratios)} shapes", flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "attention_decode.json").write_text(json.dumps(rows, indent=1))


def sdpa_times(q: Any, k: Any, v: Any, causal: bool, reps: int) -> dict[str, float]:
    """Each SDPA backend's time; grouped K/V heads (fewer than Q's) go in as they are with
    enable_gqa=True where the backend takes it, else expanded to Q's heads (then the backend reads
    `groups` times the K/V bytes: the row says so)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out = {}
    groups = q.shape[1] // k.shape[1]
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        tries = [(k, v, {"enable_gqa": True} if groups > 1 else {})]
        if groups > 1:
            tries.append((k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), {}))
        for kk, vv, kw in tries:
            try:
                with sdpa_kernel([backend]):
                    sdpa(q, kk, vv, is_causal=causal, **kw)
                    torch.cuda.synchronize()
                    out[name] = time_call(lambda: sdpa(q, kk, vv, is_causal=causal, **kw), reps)
                if groups > 1 and not kw:
                    print(f"  SDPA {name}: K/V expanded to {q.shape[1]} heads (no enable_gqa)", flush=True)
                break
            except Exception as exc:  # noqa: BLE001 - a backend torch does not offer for this shape
                print(f"  SDPA {name} unavailable{' with enable_gqa' if kw else ''}: {type(exc).__name__}: "
                      f"{str(exc)[:120]}", flush=True)
    return out


def run_shape(s: int, d: int, dtype: str, causal: bool, groups: int = 1, plain_order: bool = False,
              persistent: int = 0, stages: int = 2, query_major: bool = False) -> dict[str, Any]:
    import torch

    import tecc as tc

    b, h = max(1, 16384 // s), (2048 // d if groups == 1 else 32)
    args = attention_tensors(b, h, s, d, dtype, causal, groups)
    t0 = time.perf_counter()
    kern = tc.build(args)
    build_s = time.perf_counter() - t0
    if (plain_order or persistent or stages != 2 or query_major) and kern.plan.strategy == "online_contraction_mma":
        # the same plan, in the plain grid's order and/or persistent
        from tecc.compiler.plan import Plan, Step

        extra: dict[str, Any] = {"plain_order": True} if plain_order else {}
        if query_major:
            extra["query_major"] = True
        if persistent:
            if not kern.plan.steps[0].args.get("wgmma"):
                raise RuntimeError("--persistent is an option of the wgmma form (sm_90)")
            extra["persistent"] = persistent
        if stages != 2:
            if not kern.plan.steps[0].args.get("wgmma"):
                raise RuntimeError("--stages is an option of the wgmma form (sm_90)")
            extra["stages"] = stages
        step = Step("online_contraction_mma", {**dict(kern.plan.steps[0].args), **extra})
        kern = tc.build(args, plan=Plan((step,), kern.plan.strategy, kern.plan.reason))
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    q = torch.randn(b, h, s, d, device="cuda", dtype=tdt)
    k, v = (torch.randn(b, h // groups, s, d, device="cuda", dtype=tdt) for _ in range(2))
    o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=tdt)
    kern(q, k, v, o)
    torch.cuda.synchronize()
    # float64 reference on a slice of the batch (the whole one does not fit at S = 16k)
    bq = max(1, min(b, (1 << 22) // (s * s)))
    kv_heads = [head // groups for head in range(2)]  # the K/V heads of query heads 0 and 1
    kx, vx = (x[:bq, kv_heads] for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q[:bq, :2].double(), kx.double(), vx.double(),
                                                           is_causal=causal)
    err = float(((o[:bq, :2].double() - ref).abs() / (1 + ref.abs())).max())
    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    reps = max(5, min(30, int(5e12 / flops)))
    t_tecc = time_call(lambda: kern(q, k, v, o), reps)
    refs = sdpa_times(q, k, v, causal, reps)
    best = min(refs.values()) if refs else float("nan")
    return {"S": s, "d": d, "B": b, "H": h, "H_kv": h // groups, "dtype": dtype, "causal": causal, "rel_err": err,
            "tecc_us": t_tecc * 1e6, "tecc_tflops": flops / t_tecc / 1e12,
            **{f"sdpa_{n}_us": t * 1e6 for n, t in refs.items()}, "ratio": best / t_tecc,
            "kernels": len(kern.module.kernels), "plan": _plan_label(kern.plan), "build_s": build_s}


def _plan_label(plan: Any) -> str:
    """The plan's strategy, with the step's tiling for the tensor-core kernel ('+wgmma' for its
    Hopper form)."""
    if plan.strategy != "online_contraction_mma" or not plan.steps:
        return str(plan.strategy)
    args = dict(plan.steps[0].args)
    form = ("+wgmma" if args.get("wgmma") else "") + ("+overlap" if args.get("overlap") else "") + \
        (f"+kv_splits{args['kv_splits']}" if args.get("kv_splits") else "") + \
        ("+plain_order" if args.get("plain_order") else "") + \
        (f"+persistent{args['persistent']}" if args.get("persistent") else "") + \
        (f"+stages{args['stages']}" if args.get("stages") else "") + \
        ("+peel_guarded" if args.get("peel_guarded") else "") + ("+query_major" if args.get("query_major") else "")
    return f"{plan.strategy}{form} {args.get('rows_per_block')}x{args.get('key_tile')}"


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="S in {1k, 4k}, d = 64 only")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--gqa", action="store_true",
                    help="grouped heads: H = 32 query heads over H_kv = 8 K/V heads (d = 128, S in {1k, 4k, 8k})")
    ap.add_argument("--plain-order", action="store_true",
                    help="launch the blocks in the plain grid's order (query blocks, then heads): the order before "
                         "grouped heads side by side and the longest query blocks first, for comparison")
    ap.add_argument("--persistent", type=int, default=0, metavar="BLOCKS",
                    help="the wgmma form's persistent kernel: BLOCKS blocks (132: one per SM of an H100/H200) loop "
                         "over the (query block, head) work items, longest first")
    ap.add_argument("--stages", type=int, default=2, choices=(2, 3),
                    help="3: the planned wgmma kernel with a 3-stage K/V ring (tiles kt + 1 and kt + 2 in flight)")
    ap.add_argument("--query-major", action="store_true",
                    help="the planned kernel with its blocks launched query block major over all heads (the longest "
                         "of every head first) instead of each head's query blocks in turn")
    ap.add_argument("--dims", type=int, nargs="+", default=None, help="head dims (default 64 128; 64 with --quick)")
    ap.add_argument("--decode", action="store_true",
                    help="decoding: 1..16 query rows over 4k..64k keys (split-KV), against SDPA in the same process")
    ap.add_argument("--kv-splits", type=int, nargs="+", default=(), metavar="S",
                    help="with --decode: also time the planned tiling with these key chunk counts")
    opts = ap.parse_args()
    if opts.decode:
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {opts.dtype}", flush=True)
        decode_main(opts.dtype, opts.out, tuple(opts.kv_splits))
        return
    seqs = (1024, 4096) if opts.quick else (1024, 2048, 4096, 8192, 16384)
    dims = (64,) if opts.quick else (64, 128)
    groups = 1
    if opts.gqa:
        seqs, dims, groups = (1024, 4096, 8192), (128,), 4
    if opts.dims:
        dims = tuple(opts.dims)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {opts.dtype}", flush=True)
    print(f"{'S':>6} {'d':>4} {'B':>3} {'H':>3} {'causal':>6} {'tecc us':>10} {'TF/s':>6} {'flash us':>9} "
          f"{'cudnn us':>9} {'ratio':>6} {'rel err':>8}  plan", flush=True)
    rows = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                try:
                    row = run_shape(s, d, opts.dtype, causal, groups, opts.plain_order, opts.persistent,
                                    opts.stages, opts.query_major)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row = {"S": s, "d": d, "causal": causal, "error": f"{type(exc).__name__}: {exc}"[:400]}
                    print(row, flush=True)
                    rows.append(row)
                    continue
                rows.append(row)
                print(f"{s:6d} {d:4d} {row['B']:3d} {row['H']:3d}{'/' + str(row['H_kv']) if groups > 1 else ''} {str(causal):>6} {row['tecc_us']:10.1f} "
                      f"{row['tecc_tflops']:6.1f} {row.get('sdpa_flash_us', float('nan')):9.1f} "
                      f"{row.get('sdpa_cudnn_us', float('nan')):9.1f} {row['ratio']:6.3f} {row['rel_err']:8.1e}  "
                      f"{row['plan']} ({row['kernels']} kernel{'s' if row['kernels'] > 1 else ''})", flush=True)
                if causal and len(rows) >= 2 and "tecc_us" in rows[-2] and rows[-2]["S"] == s and rows[-2]["d"] == d:
                    row["causal_over_noncausal"] = row["tecc_us"] / rows[-2]["tecc_us"]
                    print(f"{'':>6} causal / non-causal time: {row['causal_over_noncausal']:.3f} (issue 15's target "
                          "<= 0.55 at S = 8k)", flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r and r["ratio"] == r["ratio"]]
    if ratios:
        print(f"geometric mean ratio vs the fastest SDPA backend: "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.4f} over {len(ratios)} shapes", flush=True)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / "attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
