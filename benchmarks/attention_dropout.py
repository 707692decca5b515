"""Dropout inside attention: the forward and tc.grad's backward of attention with dropout 0.1 on
the probabilities vs tecc's dropout-free kernels and SDPA with dropout_p = 0.1, in one process
(docs/training.md, "Dropout inside attention").

    python benchmarks/attention_dropout.py [--quick] [--dtype float16|bfloat16] [--p 0.1]
                                           [--seqs 1024 4096] [--dims 64 128] [--out DIR]

The program is docs/attention.md's with P = exp(S - m) / l dropped by
`where(rand[b, h, i, j] < p, 0, P / (1 - p))` (rand = tc.rand((B, H, S, S), seed, offset), the seed
an int64 tensor); B and S symbolic, so each (d, causal) builds once (planned for B = 4, S = 4096): the dropout forward (one
kernel), the dropout-free forward, and for each tc.grad's forward (O and the log-sum-exp) and
backward (at most three kernels). Checked on the GPU against float64 torch for batch 0, head 0:
the mask is tecc's own tc.rand of the same (seed, offset, shape) built as a separate kernel
(bit-identical draws are the emulator tests' business; here the mask's use is checked), the
forward O and the backward's dQ, dK, dV (|err| / (1 + |want|)).

Timed with CUDA events (median): the forward and the backward with and without dropout, and
SDPA's flash backend with dropout_p = p (its forward; its backward after a forward under the
backend; cuDNN is tried too and reported when it does not take dropout). Ratios: `fwd keep` =
tecc's dropout-free forward time over its dropout forward time (target >= 0.85), `bwd keep`
likewise for the backward; `vs sdpa` = the fastest SDPA dropout time over tecc's (> 1: tecc
faster). B = 16384 / S, H = 2048 / d. `--quick`: d = 64, S in {1k, 4k}: under 3 minutes.
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

SEED, OFFSET = 20261129, 3
# the sizes the plans are made for (B and S are symbolic): 16k tokens, as the timed rows
PLANNED_SIZES = {"B": 4, "S": 4096}
_BUILT: dict[tuple[Any, ...], Any] = {}


def dropout_attention(h: int, d: int, dtype: str, causal: bool, p: float | None) -> tuple[list[Any], Any]:
    """(inputs, O) of attention with dropout `p` on the probabilities (None: without), B and S
    symbolic, the seed an int64 tensor when dropping."""
    import tecc as tc

    B, S = tc.var("B"), tc.var("S")
    Q = tc.placeholder((B, h, S, d), dtype, name="Q")
    K = tc.placeholder((B, h, S, d), dtype, name="K")
    V = tc.placeholder((B, h, S, d), dtype, name="V")
    r = tc.reduce_axis(d, name="d")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    scale = 1.0 / math.sqrt(d)

    def score(b: Any, hh: Any, i: Any, j: Any) -> Any:
        x = tc.sum(tc.cast(Q[b, hh, i, r], "float32") * tc.cast(K[b, hh, j, r], "float32"), axis=r) * scale
        return tc.where(j <= i, x, -math.inf) if causal else x

    Sc = tc.compute((B, h, S, S), score, name="S")
    m = tc.compute((B, h, S), lambda b, hh, i: tc.max(Sc[b, hh, i, j1], axis=j1), name="m")
    e = tc.compute((B, h, S, S), lambda b, hh, i, j: tc.exp(Sc[b, hh, i, j] - m[b, hh, i]), name="e")
    l = tc.compute((B, h, S), lambda b, hh, i: tc.sum(e[b, hh, i, j2], axis=j2), name="l")
    ins = [Q, K, V]
    if p is None:
        O = tc.compute((B, h, S, d), lambda b, hh, i, c: tc.cast(
            tc.sum(e[b, hh, i, j3] * tc.cast(V[b, hh, j3, c], "float32"), axis=j3) / l[b, hh, i], dtype), name="O")
        return ins, O
    seed = tc.placeholder((), "int64", name="seed")
    ins.append(seed)
    R = tc.rand((B, h, S, S), seed, OFFSET, name="R")
    P = tc.compute((B, h, S, S), lambda b, hh, i, j: e[b, hh, i, j] / l[b, hh, i], name="P")
    Pd = tc.compute((B, h, S, S), lambda b, hh, i, j: tc.where(R[b, hh, i, j] < p, 0, P[b, hh, i, j] / (1 - p)),
                    name="Pd")
    O = tc.compute((B, h, S, d), lambda b, hh, i, c: tc.cast(
        tc.sum(Pd[b, hh, i, j3] * tc.cast(V[b, hh, j3, c], "float32"), axis=j3), dtype), name="O")
    return ins, O


def built(h: int, d: int, dtype: str, causal: bool, p: float) -> dict[str, Any]:
    """The kernels of one configuration (built once): forward with and without dropout, tc.grad's
    forward and backward with dropout, the dropout-free ones, and the head-0 mask (the first S·S
    draws of the same stream)."""
    import tecc as tc

    key = (h, d, dtype, causal, p)
    if key in _BUILT:
        return _BUILT[key]
    t0 = time.perf_counter()
    ins, O = dropout_attention(h, d, dtype, causal, p)
    free_ins, free_O = dropout_attention(h, d, dtype, causal, None)
    g = tc.grad(O, ins[:3])
    g_free = tc.grad(free_O, free_ins)
    # head 0 of batch 0 of rand((B, H, S, S)): linear indices i·S + j, those of rand((S, S))
    seed = tc.placeholder((), "int64", name="seed")
    n = tc.var("N")
    head0 = tc.rand((n, n), seed, OFFSET, name="R_head0")
    sizes = PLANNED_SIZES

    def build(args: list[Any]) -> Any:
        return tc.build(args, sizes=sizes)
    out = {"fwd": build(ins + [O]), "fwd_free": build(free_ins + [free_O]), "grad": g,
           "grad_fwd": build(list(g.forward)), "bwd": build(g.args), "bwd_free": build(g_free.args),
           "grad_fwd_free": build(list(g_free.forward)), "mask": tc.build([seed, head0], sizes={"N": sizes["S"]}),
           "build_s": time.perf_counter() - t0}
    _BUILT[key] = out
    return out


def sdpa_dropout_times(q: Any, k: Any, v: Any, do: Any, causal: bool, p: float, reps: int) -> dict[str, float]:
    """SDPA's forward and backward times with dropout_p = p per backend that takes it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    out: dict[str, float] = {}
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                with torch.no_grad():
                    sdpa(q, k, v, is_causal=causal, dropout_p=p)
                    torch.cuda.synchronize()
                    out[f"{name}_fwd"] = time_call(lambda: sdpa(q, k, v, is_causal=causal, dropout_p=p), reps)
                o = sdpa(qq, kk, vv, is_causal=causal, dropout_p=p)
                # the gradients returned, not added into .grad (that would time three adds per call)
                torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
                torch.cuda.synchronize()
                out[f"{name}_bwd"] = time_call(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True), reps)
        except Exception as exc:  # noqa: BLE001 - a backend without dropout for this shape
            print(f"  SDPA {name} with dropout_p={p} unavailable: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    return out


def reference_errors(q: Any, k: Any, v: Any, do: Any, o: Any, grads: list[Any], keep: Any, causal: bool,
                     p: float) -> tuple[float, float]:
    """max |tecc - float64| / (1 + |float64|) of O and of dQ, dK, dV at batch 0, head 0, the
    float64 attention dropping where `keep` (the head's tc.rand mask) is false."""
    import torch

    qq, kk, vv = (t[:1, :1].double().requires_grad_() for t in (q, k, v))
    s = qq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    want = (torch.softmax(s, -1) * keep.double() / (1 - p)) @ vv
    want.backward(do[:1, :1].double())
    err_o = float(((o[:1, :1].double() - want).abs() / (1 + want.abs())).max())
    got = (grads[0][:1, :1], grads[1][:1, :1], grads[2][:1, :1])
    err_g = max(float(((g.double() - w.grad).abs() / (1 + w.grad.abs())).max()) for g, w in zip(got, (qq, kk, vv)))
    return err_o, err_g


def run_shape(s: int, d: int, dtype: str, causal: bool, p: float) -> dict[str, Any]:
    import torch

    b, h = max(1, 16384 // s), 2048 // d
    k_ = built(h, d, dtype, causal, p)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(3))
    seed = torch.tensor(SEED, dtype=torch.int64, device="cuda")
    o = torch.full((b, h, s, d), float("nan"), device="cuda", dtype=tdt)
    o_free = torch.full_like(o, float("nan"))
    lse = torch.full((b, h, s), float("nan"), device="cuda", dtype=torch.float32)
    lse_free = torch.full_like(lse, float("nan"))
    k_["fwd"](q, k, v, seed, o)
    k_["fwd_free"](q, k, v, o_free)
    o_g = torch.full_like(o, float("nan"))
    g = k_["grad"]   # its inputs: Q, K, V and the seed, in the order tc.grad found them
    by_name = {"Q": q, "K": k, "V": v, "seed": seed}
    k_["grad_fwd"](*[by_name[t.name] for t in g.inputs], o_g, lse)
    k_["grad_fwd_free"](q, k, v, o_free, lse_free)
    do = torch.randn(b, h, s, d, device="cuda", dtype=tdt)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    grads_free = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    bwd_args = [by_name[t.name] for t in g.inputs] + [o_g, lse, do, *grads]
    k_["bwd"](*bwd_args)
    k_["bwd_free"](q, k, v, o_free, lse_free, do, *grads_free)
    mask = torch.full((s, s), float("nan"), device="cuda", dtype=torch.float32)
    k_["mask"](seed, mask)
    torch.cuda.synchronize()
    keep = ~(mask < p)
    err_o, err_g = reference_errors(q, k, v, do, o_g, grads, keep, causal, p)
    same_o = bool(torch.equal(o, o_g))
    flops = 4.0 * b * h * s * s * d / (2 if causal else 1)
    reps = max(5, min(30, int(1e13 / flops)))
    t = {"fwd": time_call(lambda: k_["fwd"](q, k, v, seed, o), reps),
         "fwd_free": time_call(lambda: k_["fwd_free"](q, k, v, o_free), reps),
         "bwd": time_call(lambda: k_["bwd"](*bwd_args), reps),
         "bwd_free": time_call(lambda: k_["bwd_free"](q, k, v, o_free, lse_free, do, *grads_free), reps)}
    refs = sdpa_dropout_times(q, k, v, do, causal, p, reps)
    best_f = min([v_ for n, v_ in refs.items() if n.endswith("_fwd")], default=float("nan"))
    best_b = min([v_ for n, v_ in refs.items() if n.endswith("_bwd")], default=float("nan"))
    return {"S": s, "d": d, "B": b, "H": h, "dtype": dtype, "causal": causal, "p": p,
            "rel_err_O": err_o, "rel_err_grads": err_g, "forward_outputs_equal": same_o,
            **{f"tecc_{n}_us": x * 1e6 for n, x in t.items()}, **{f"sdpa_{n}_us": x * 1e6 for n, x in refs.items()},
            "fwd_keep": t["fwd_free"] / t["fwd"], "bwd_keep": t["bwd_free"] / t["bwd"],
            "fwd_vs_sdpa": best_f / t["fwd"], "bwd_vs_sdpa": best_b / t["bwd"],
            "kernels": [len(k_["fwd"].module.kernels), len(k_["bwd"].module.kernels)],
            "plans": [k_["fwd"].plan.strategy, k_["bwd"].plan.strategy], "build_s": k_["build_s"]}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="d = 64, S in {1k, 4k}")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--p", type=float, default=0.1, help="the dropout probability")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default 1k 2k 4k 8k)")
    ap.add_argument("--dims", type=int, nargs="+", default=None, help="head dims (default 64 128)")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    seqs = tuple(opts.seqs) if opts.seqs else ((1024, 4096) if opts.quick else (1024, 2048, 4096, 8192))
    dims = tuple(opts.dims) if opts.dims else ((64,) if opts.quick else (64, 128))
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {opts.dtype}  p {opts.p}", flush=True)
    print(f"{'S':>6} {'d':>4} {'causal':>6} {'fwd us':>9} {'free us':>9} {'keep':>5} {'sdpa us':>9} {'vs sdpa':>7} "
          f"{'bwd us':>9} {'free us':>9} {'keep':>5} {'sdpa us':>9} {'vs sdpa':>7} {'err O':>8} {'err dX':>8}  kernels",
          flush=True)
    rows: list[dict[str, Any]] = []
    for d in dims:
        for s in seqs:
            for causal in (False, True):
                try:
                    row = run_shape(s, d, opts.dtype, causal, opts.p)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    row = {"S": s, "d": d, "causal": causal, "error": f"{type(exc).__name__}: {exc}"[:400]}
                    print(row, flush=True)
                    rows.append(row)
                    continue
                rows.append(row)
                sf = min([row.get(f"sdpa_{n}_fwd_us", math.inf) for n in ("flash", "cudnn")])
                sb = min([row.get(f"sdpa_{n}_bwd_us", math.inf) for n in ("flash", "cudnn")])
                print(f"{s:6d} {d:4d} {str(causal):>6} {row['tecc_fwd_us']:9.1f} {row['tecc_fwd_free_us']:9.1f} "
                      f"{row['fwd_keep']:5.2f} {sf:9.1f} {row['fwd_vs_sdpa']:7.3f} {row['tecc_bwd_us']:9.1f} "
                      f"{row['tecc_bwd_free_us']:9.1f} {row['bwd_keep']:5.2f} {sb:9.1f} {row['bwd_vs_sdpa']:7.3f} "
                      f"{row['rel_err_O']:8.1e} {row['rel_err_grads']:8.1e}  {row['kernels']}"
                      , flush=True)
    for what in ("fwd_keep", "bwd_keep", "fwd_vs_sdpa", "bwd_vs_sdpa"):
        vals = [r[what] for r in rows if what in r and r[what] == r[what] and r[what] > 0]
        if vals:
            print(f"{what}: geometric mean {math.exp(sum(map(math.log, vals)) / len(vals)):.3f}, lowest {min(vals):.3f} "
                  f"over {len(vals)} shapes{' (target >= 0.85 each)' if what.endswith('keep') else ''}", flush=True)
    if opts.out:
        Path(opts.out).mkdir(parents=True, exist_ok=True)
        (Path(opts.out) / f"attention_dropout_{opts.dtype}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
