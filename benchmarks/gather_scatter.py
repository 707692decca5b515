"""Gathers and scatter-adds (data-dependent indices) against PyTorch, on one GPU.

    python benchmarks/gather_scatter.py [--reps 50] [--tokens 8192] [--vocab 50257] [--width 768]

Rows (GPT-2 small's shapes by default, float32 and bfloat16, int64 indices):
  embedding        Y[i, j] = W[idx[i], j]                    torch.nn.functional.embedding
  target_pick      p[i] = logits[i, target[i]]               logits.gather(1, target[:, None])
  embedding_bwd    dW[idx[i], j] += dY[i, j]  (atomics)      torch.zeros(V, D).index_add_(0, idx, dY) and
                                                             aten.embedding_dense_backward (sorted)
  embedding_bwd_det  the same with build(deterministic=True), on a vocabulary of --det-vocab rows
                   (the deterministic sum scans every token per output row: V·N·D steps)

tecc and torch run in this process on torch's current stream, timed with CUDA events (median of
--reps groups of 10 launches after warm-up); every tecc result is checked against torch's first
(max relative error printed). "vs best" is the fastest torch time / tecc's time (1.0: as fast).
tecc's predicted time (the plan's) is printed next to the measured one, so the scatter_atomic
strategy's constants (ATOMIC_SAME_ADDRESS_CYCLES, strategies/scatter_atomic.py) can be checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tecc as tc  # noqa: E402

INNER = 10
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def time_it(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    stream = torch.cuda.current_stream()
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        for _ in range(INNER):
            fn()
        e1.record(stream)
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e-3 / INNER)
    return statistics.median(times)


def predicted(kernel: tc.Kernel) -> float:
    planning = kernel.planning
    return planning.predicted_seconds if planning is not None else float("nan")


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.double(), want.double()
    return float(((g - w).abs() / (1.0 + w.abs())).max()) if w.numel() else 0.0


def report(name: str, dtype: str, kernel: tc.Kernel, tecc_s: float, refs: dict[str, float], err: float) -> None:
    best = min(refs.values())
    refs_text = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in refs.items())
    print(f"{name:18s} {dtype:9s} tecc {tecc_s * 1e6:8.1f} us (predicted {predicted(kernel) * 1e6:8.1f}) | {refs_text} | "
          f"vs best {best / tecc_s:5.2f} | err {err:.1e} | {kernel.plan.strategy}", flush=True)


def embedding(n: int, v: int, d: int, dtype: str, reps: int) -> None:
    W = tc.placeholder((v, d), dtype, name="W")
    idx = tc.placeholder((n,), "int64", name="idx")
    Y = tc.compute((n, d), lambda i, j: W[idx[i], j], name="Y")
    f = tc.build([W, idx, Y], target="cuda")
    w = torch.randn(v, d, device="cuda").to(TORCH[dtype])
    ix = torch.randint(0, v, (n,), device="cuda")
    y = torch.empty(n, d, device="cuda", dtype=TORCH[dtype])
    f(w, ix, y)
    torch.cuda.synchronize()
    err = max_rel(y, torch.nn.functional.embedding(ix, w))
    tecc_s = time_it(lambda: f(w, ix, y), reps)
    refs = {"F.embedding": time_it(lambda: torch.nn.functional.embedding(ix, w), reps)}
    report("embedding", dtype, f, tecc_s, refs, err)


def target_pick(n: int, c: int, dtype: str, reps: int) -> None:
    logits = tc.placeholder((n, c), dtype, name="logits")
    target = tc.placeholder((n,), "int64", name="target")
    p = tc.compute((n,), lambda i: logits[i, target[i]], name="p")
    f = tc.build([logits, target, p], target="cuda")
    x = torch.randn(n, c, device="cuda").to(TORCH[dtype])
    t = torch.randint(0, c, (n,), device="cuda")
    out = torch.empty(n, device="cuda", dtype=TORCH[dtype])
    f(x, t, out)
    torch.cuda.synchronize()
    err = max_rel(out, x.gather(1, t[:, None])[:, 0])
    refs = {"gather": time_it(lambda: x.gather(1, t[:, None]), reps)}
    report("target_pick", dtype, f, time_it(lambda: f(x, t, out), reps), refs, err)


def embedding_backward(n: int, v: int, d: int, dtype: str, reps: int, deterministic: bool) -> None:
    dY = tc.placeholder((n, d), dtype, name="dY")
    idx = tc.placeholder((n,), "int64", name="idx")
    dW = tc.scatter_add((v, d), (n, d), at=lambda i, j: (idx[i], j), value=lambda i, j: dY[i, j], name="dW")
    f = tc.build([dY, idx, dW], target="cuda", deterministic=deterministic)
    g = torch.randn(n, d, device="cuda").to(TORCH[dtype])
    ix = torch.randint(0, v, (n,), device="cuda")
    out = torch.empty(v, d, device="cuda", dtype=TORCH[dtype])
    f(g, ix, out)
    torch.cuda.synchronize()
    want = torch.zeros(v, d, device="cuda", dtype=torch.float64).index_add_(0, ix, g.double())
    err = max_rel(out, want)
    refs = {
        "index_add_": time_it(lambda: torch.zeros(v, d, device="cuda", dtype=TORCH[dtype]).index_add_(0, ix, g), reps),
        "embedding_dense_backward": time_it(
            lambda: torch.ops.aten.embedding_dense_backward(g, ix, v, -1, False), reps),
    }
    report("embedding_bwd_det" if deterministic else "embedding_bwd", dtype, f,
           time_it(lambda: f(g, ix, out), reps), refs, err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--det-vocab", type=int, default=512)
    a = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: tokens {a.tokens}, vocab {a.vocab}, width {a.width}")
    for dtype in ("float32", "bfloat16"):
        embedding(a.tokens, a.vocab, a.width, dtype, a.reps)
        target_pick(a.tokens, a.vocab, dtype, a.reps)
        embedding_backward(a.tokens, a.vocab, a.width, dtype, a.reps, deterministic=False)
        embedding_backward(a.tokens, a.det_vocab, a.width, dtype, max(3, a.reps // 10), deterministic=True)


if __name__ == "__main__":
    main()
