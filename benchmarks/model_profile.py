"""Where a model step's GPU time goes, measured: every kernel of a GPT-2 training step under each
backend, by CUPTI (torch.profiler), side by side (the measured counterpart of model_kernels.py).

    python benchmarks/model_profile.py                         # GPT-2 small, 2 layers, eager/inductor/tecc
    python benchmarks/model_profile.py --layers 12 --top 40 --backends inductor tecc
    python benchmarks/model_profile.py --cudagraphs            # tecc also with options={"cudagraphs": True}
    python benchmarks/model_profile.py --aot-default           # tecc also with options={"partitioner": "default"}
    python benchmarks/model_profile.py --layers 12 --gaps 25   # also where the GPU waits for the host

The model and step are benchmarks/models.py's (bf16 autocast, AdamW outside the compiled model,
batch 8 x 1024 tokens). After --warmup steps, --steps steps run under the profiler. Per backend:
the step time (CUDA events, median), the sum of the step's kernel durations (the GPU busy time;
the difference is launch gaps, i.e. host time the GPU waited for), the kernel count, and the top
kernels by time per step with their launch counts. tecc's kernel names are its programs' names,
which name the FX nodes they compute (dump_ir maps them back).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

from gemm import kernel_durations  # noqa: E402  (benchmarks/gemm.py)
from models import _batches  # noqa: E402  (benchmarks/models.py)
from train_gpt import GPT  # noqa: E402


def _step(run, opt, idx, targets):
    """One training step (bf16 autocast, backward, AdamW), as benchmarks/models.py runs it;
    returns the loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = run(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def cupti_calls(fn, calls: int) -> tuple[list[float], dict[str, list[float]]]:
    """`calls` calls of fn under torch.profiler (CUPTI): each call's time in ms (CUDA events,
    synchronized) and every kernel's durations in us by name (benchmarks/models_hf.py uses it too)."""
    times = []

    def timed() -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))

    kernels = kernel_durations(timed, calls)
    return times, kernels


def host_profile(label: str, steps: Sequence[Callable[[], Any]], top: int) -> None:
    """The host's time per step by Python function (cProfile over the steps, each synchronized):
    what the CPU does between launches when the GPU waits. `steps`: one call per step
    (benchmarks/models_hf.py passes its own)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for step in steps:
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
    print(f"\n### {label}: host time by function over {len(steps)} step(s) (cProfile, tottime)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def gap_profile(label: str, steps: Sequence[Callable[[], Any]], top: int, synchronized: bool = False) -> None:
    """Where the GPU waits within the steps: the steps run back to back (no synchronization
    between them, as in training) under torch.profiler with CPU and CUDA activity; the GPU's idle
    time is the profiled window from the first kernel's start to the last one's end less the
    union of the kernels' intervals. Prints it per step and the `top` longest gaps, each with the
    kernels before and after it and the host's events (torch ops, CUDA API calls) that overlap
    it longest: what the host was doing while the GPU had nothing queued. `synchronized`: each
    step waits for the GPU before the next starts (as a timing loop that synchronizes per step
    does): the host's time to the next step's first kernel is then a gap too."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for step in steps:
            step()
            if synchronized:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == cuda and e.device_time > 0),
                     key=lambda e: e.time_range.start)
    host = [e for e in events if e.device_type == cpu]
    if not kernels:
        print(f"\n### {label}: no kernels recorded")
        return
    gaps, end, busy = [], kernels[0].time_range.start, 0.0
    prev = None
    for k in kernels:
        start, stop = k.time_range.start, k.time_range.end
        if start > end:
            gaps.append((start - end, end, start, prev.name if prev else "", k.name))
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, prev = stop, k
    window = end - kernels[0].time_range.start
    count = len(steps)
    how = "synchronized" if synchronized else "back-to-back"
    print(f"\n### {label}: GPU idle within {count} {how} step(s): {(window - busy) / count / 1e3:.2f} ms per "
          f"step of {window / count / 1e3:.2f} ms ({len(gaps) / count:.0f} gaps per step; "
          f"{sum(g[0] for g in gaps if g[0] > 20) / count / 1e3:.2f} ms per step in gaps over 20 us)")
    print("| gap us | after kernel | before kernel | host events overlapping it (us of overlap) |")
    print("| --- | --- | --- | --- |")
    for length, a, b, before, after in sorted(gaps, reverse=True)[:top]:
        overlap = []
        for e in host:
            o = min(e.time_range.end, b) - max(e.time_range.start, a)
            if o > 0.2 * length:
                overlap.append((o, e.name))
        names = ", ".join(f"{n[:40]} ({o:.0f})" for o, n in sorted(overlap, reverse=True)[:5])
        print(f"| {length:.0f} | {before[:50]} | {after[:50]} | {names} |")


def profile(label: str, run, model, data, warmup: int, top: int, host: int = 0, gaps: int = 0) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for idx, targets in data[:warmup]:
        _step(run, opt, idx, targets)
    torch.cuda.synchronize()
    timed = data[warmup:]
    batches = iter(timed)
    times, kernels = cupti_calls(lambda: _step(run, opt, *next(batches)), len(timed))
    steps = len(timed)
    busy = sum(sum(v) for v in kernels.values()) / steps / 1e3
    count = sum(len(v) for v in kernels.values()) / steps
    print(f"\n## {label}: step {statistics.median(times):.2f} ms (events, median of {steps}), "
          f"kernels {busy:.2f} ms busy, {count:.0f} kernels per step")
    print("| ms per step | launches per step | mean us | kernel |\n| --- | --- | --- | --- |")
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    for name, durations in rows[: top or None]:
        total = sum(durations) / steps / 1e3
        print(f"| {total:.3f} | {len(durations) / steps:.0f} | {statistics.mean(durations):.1f} | {name[:110]} |")
    if label.startswith("tecc"):
        from tecc.runtime.graphs import TOTALS
        print(f"tecc's CUDA graphs of repeated calls so far in this process: {TOTALS}")
    calls = [lambda batch=batch: _step(run, opt, *batch) for batch in timed]
    if host:
        host_profile(label, calls, host)
    if gaps:
        gap_profile(label, calls, gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "masked"])
    p.add_argument("--backends", nargs="+", default=["eager", "inductor", "tecc"])
    p.add_argument("--cudagraphs", action="store_true", help="also tecc with options={'cudagraphs': True}")
    p.add_argument("--aot-default", action="store_true",
                   help="also tecc with options={'partitioner': 'default'} (AOTAutograd's default partitioner)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--host", type=int, default=0, help="also the host's top N Python functions by time (cProfile)")
    p.add_argument("--gaps", type=int, default=0,
                   help="also the GPU's idle time between kernels and its N longest gaps with the host's events then")
    args = p.parse_args()
    vocab, width, heads, context, batch = 50304, 768, 12, 1024, 8
    torch.manual_seed(0)
    base = GPT(vocab, width, heads, args.layers, context, args.attention).cuda()
    data = _batches(args.warmup + args.steps, batch, context, vocab)
    variants = [(b, {}) for b in args.backends]
    if args.cudagraphs:
        variants.append(("tecc", {"cudagraphs": True}))
    if args.aot_default:
        variants.append(("tecc", {"partitioner": "default"}))
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; GPT-2 {args.layers}L {args.attention}")
    for backend, options in variants:
        torch._dynamo.reset()
        model = GPT(vocab, width, heads, args.layers, context, args.attention).cuda()
        model.load_state_dict(base.state_dict())
        if backend == "eager":
            run = model
        elif backend == "inductor":
            run = torch.compile(model)
        else:
            run = torch.compile(model, backend="tecc", options={"fallback": "aten", **options})
        label = backend + (f" {options}" if options else "")
        try:
            profile(label, run, model, data, args.warmup, args.top, args.host, args.gaps)
        except Exception as exc:  # noqa: BLE001 - one failing backend is reported, the others still run
            print(f"\n## {label}: failed: {type(exc).__name__}: {str(exc)[:300]}")
        del model, run
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
