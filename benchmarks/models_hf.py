"""Models written by others, unmodified: eager, inductor and tecc side by side (docs/models.md).

    python benchmarks/models_hf.py --quick       # GPT-2 small (SDPA) training + resnet50 inference, ~4 min on an H200
    python benchmarks/models_hf.py               # also GPT-2 with transformers' "eager" attention, more steps
    python benchmarks/models_hf.py --tiny        # the CPU tests' small sizes (CPU: eager and tecc in the emulator)
    python benchmarks/models_hf.py --quick --models gpt2 --memory-snapshot /tmp/mem   # who holds the peak
    python benchmarks/models_hf.py --quick --models gpt2 --profile 40 --gaps 25   # kernels, and where the GPU waits

GPT-2: transformers.GPT2LMHeadModel(GPT2Config()) (12 layers, width 768, 12 heads, vocabulary
50257, random weights), batch 8 x 1024 tokens, bf16 autocast, dropout 0, the loss from
`labels=`, AdamW (lr 1e-4) outside the compiled model; every backend starts from the same
weights and sees the same batches. A step is forward + backward + optimizer step; the median
step time after the warm-up steps is reported (CUDA events, one process), with the first call's
wall time (the compile) and the largest |loss - eager loss| over the steps (tecc's bound: 2e-2).

resnet50: torchvision.models.resnet50() (random weights) in eval, bf16, channels_last, batch 32 x
224²: median inference time and the relative error against eager in float32 (max |y - y_fp32| /
max |y_fp32|; tecc's bound 3e-2, inductor's is about 1.1e-2).

tecc compiles with fallback="error" (--fallback aten to run ops it cannot lower as ATen and list
them). transformers and torchvision are not tecc dependencies: a missing one is said and its
model skipped.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import logging
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch

BACKENDS = ("eager", "inductor", "tecc")


def _package(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a missing or broken install: say which and skip
        print(f"{name} is not importable ({type(exc).__name__}: {exc}); its model is skipped. Install it "
              f"(pip install --no-deps --target DIR {name} ...; PYTHONPATH=DIR) to run it.")
        return None


def _compiled(model: Any, backend: str, fallback: str, partitioner: str = "recompute") -> Any:
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model)
    return torch.compile(model, backend="tecc", options={"fallback": fallback, "partitioner": partitioner})


class _Timer:
    """CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[Any, float, float]:
        """fn's result, its time in ms (events) and its wall time in s."""
        wall = time.perf_counter()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return out, start.elapsed_time(end), time.perf_counter() - wall
        out = fn()
        elapsed = time.perf_counter() - wall
        return out, elapsed * 1e3, elapsed


def _kernel_profile(label: str, fn: Callable[[], Any], calls: int, top: int) -> None:
    """`calls` more calls of fn under torch.profiler (CUPTI): the GPU's busy time per call (the
    sum of its kernels' durations) against the call's time, so a gap shows host time the GPU
    waited for, and the top kernels by time."""
    from model_profile import cupti_calls  # benchmarks/model_profile.py

    times, kernels = cupti_calls(fn, calls)
    busy = sum(sum(v) for v in kernels.values()) / calls / 1e3
    count = sum(len(v) for v in kernels.values()) / calls
    print(f"\n## {label}: {statistics.median(times):.2f} ms per call (events), kernels busy {busy:.2f} ms, "
          f"{count:.0f} kernels per call")
    print("| ms per call | launches per call | mean us | kernel |\n| --- | --- | --- | --- |")
    for name, durations in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"| {sum(durations) / calls / 1e3:.3f} | {len(durations) / calls:.0f} | {statistics.mean(durations):.1f} "
              f"| {name[:110]} |")
    _launch_cache_counts()


def _host_probe(launches: int = 2000) -> float:
    """The host's time per eager launch of a tiny kernel (`add_` on 256 floats), median of 5
    rounds, in us. The comparison with inductor is host-sensitive (inductor launches ~780 kernels
    per GPT-2 step from Python, tecc replays a CUDA graph per program): a machine whose probe is
    well above the others' gives ratios that are not comparable with theirs (RESULTS.md, stop 41)."""
    x = torch.zeros(256, device="cuda")
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            x.add_(1.0)
        rounds.append((time.perf_counter() - start) / launches * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def _host_and_gaps(args: argparse.Namespace, label: str, make_steps: Callable[[], list[Callable[[], Any]]]) -> None:
    """--gaps N / --host N (CUDA only): where the GPU waited for the host within three of the
    steps `make_steps` gives (made only then), each synchronized as the timing loop's are, and the
    host's top N Python functions over the other three (benchmarks/model_profile.py)."""
    if args.device != "cuda" or not (args.host or args.gaps):
        return
    from model_profile import gap_profile, host_profile  # benchmarks/model_profile.py

    steps = make_steps()
    if args.gaps:
        gap_profile(label, steps[:3], args.gaps, synchronized=True)
    if args.host:
        host_profile(label, steps[3:], args.host)


def _launch_cache_counts() -> None:
    """tecc's programs compiled in this process: how their calls ran so far (the launch cache's
    hits against full checked calls; a program whose every call is checked pays tens of
    microseconds of Python per kernel, docs/runtime.md "Repeated calls")."""
    import gc

    from tecc.torch.runtime import CompiledGraph

    # the compiled graphs are held by dynamo's and AOTAutograd's wrappers, not by tecc: found
    # among the live objects (a benchmark's look, not an API)
    for graph in [o for o in gc.get_objects() if _is_graph(o, CompiledGraph)]:
        for program in graph.programs:
            executor = getattr(program.kernel, "_executor", None)
            if executor is not None:
                print(f"tecc {graph.name} / {program.name}: {executor.calls_cached} call(s) from the launch cache, "
                      f"{executor.calls_checked} checked in full")


def _is_graph(o: object, kind: type) -> bool:
    """isinstance(o, kind), False for a weak proxy whose object is gone (gc lists them)."""
    try:
        return isinstance(o, kind)
    except ReferenceError:
        return False


def _row(model: str, backend: str, times: list[float], first: float, error: str, peak: str) -> str:
    ms = f"{statistics.median(times):.2f}" if times else "-"
    return f"| {model} | {backend} | {ms} | {first:.1f} | {error} | {peak} |"


def _peak(device: str) -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if device == "cuda" else "-"


def _reset(device: str) -> None:
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _record_memory(args: argparse.Namespace, label: str, backend: str, start: bool) -> None:
    """--memory-snapshot DIR: torch's allocation history over a backend's steps, dumped as
    DIR/<model>_<backend>.pickle (open it at pytorch.org/memory_viz: what is live at the peak,
    and who allocated it); after tecc's steps, the bytes of tecc's stream arenas (the kernel
    temporaries of every program, tecc/runtime/arena.py), printed either way."""
    if args.device != "cuda":
        return
    if not start and backend == "tecc":
        from tecc.runtime.arena import arena_bytes

        print(f"{label} / tecc: stream arenas {arena_bytes() / 2**30:.3f} GiB, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if not args.memory_snapshot:
        return
    if start:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        return
    from pathlib import Path

    path = Path(args.memory_snapshot) / f"{label.replace(' ', '_')}_{backend}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"{label} / {backend}: memory history in {path}")


def gpt2(args: argparse.Namespace, transformers: Any) -> list[str]:
    rows = []
    for attention in args.attention:
        torch.manual_seed(0)
        sizes = dict(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128, bos_token_id=0,
                     eos_token_id=0) if args.tiny else {}
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         attn_implementation=attention, **sizes)
        base = transformers.GPT2LMHeadModel(config).to(args.device).train()
        batch, length = (2, 16) if args.tiny else (8, 1024)
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(0, config.vocab_size, (batch, length), generator=g).to(args.device)
                for _ in range(args.gpt2_steps)]
        label = f"GPT2LMHeadModel {config.n_layer}L {attention}"
        results: dict[str, tuple[list[float], float, list[float], str]] = {}
        for backend in args.backends:
            _reset(args.device)
            model = copy.deepcopy(base)
            try:
                run = _compiled(model, backend, args.fallback, args.partitioner)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                time_it = _Timer(args.device)

                def step(ids: torch.Tensor) -> float:
                    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=not args.tiny):
                        loss = run(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss

                losses, times, first = [], [], 0.0
                _record_memory(args, label, backend, start=True)
                for i, ids in enumerate(data):
                    loss, ms, wall = time_it(lambda: step(ids))
                    first = wall if i == 0 else first
                    if i >= args.warmup:
                        times.append(ms)
                    losses.append(loss.item())
                results[backend] = (times, first, losses, _peak(args.device))
                _record_memory(args, label, backend, start=False)
                if args.profile and args.device == "cuda":
                    _kernel_profile(f"{label} / {backend}", lambda: step(data[-1]), 2, args.profile)
                def fresh_steps() -> list[Callable[[], Any]]:
                    # new batches, as every timed step had (tensors seen before replay what they ran as)
                    batches = [torch.randint(0, config.vocab_size, (batch, length), generator=g).to(args.device)
                               for _ in range(6)]
                    return [lambda ids=ids: step(ids) for ids in batches]

                _host_and_gaps(args, f"{label} / {backend}", fresh_steps)
            except Exception:  # noqa: BLE001 - report the failure, go on with the other backends
                print(f"{label} / {backend} failed:\n{traceback.format_exc()}")
            del model
        eager = results.get("eager")
        for backend, (times, first, losses, peak) in results.items():
            diff = f"{max(abs(a - b) for a, b in zip(losses, eager[2])):.2e}" if eager else "-"
            rows.append(_row(label, backend, times, first, f"max |Δloss| {diff}", peak))
        print(f"\nlosses per step ({label}):")
        print("step " + " ".join(f"{b:>10s}" for b in results))
        for i in range(len(data)):
            print(f"{i:4d} " + " ".join(f"{results[b][2][i]:10.4f}" for b in results))
    return rows


def resnet50(args: argparse.Namespace, torchvision: Any) -> list[str]:
    torch.manual_seed(0)
    base = torchvision.models.resnet50().to(args.device).eval()
    shape = (1, 3, 32, 32) if args.tiny else (32, 3, 224, 224)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    x = torch.randn(*shape, device=args.device)
    with torch.no_grad():
        reference = base(x).float()
    label = f"resnet50 {str(dtype).split('.')[-1]} b{shape[0]} channels_last"
    rows = []
    for backend in args.backends:
        _reset(args.device)
        model = copy.deepcopy(base).to(dtype).to(memory_format=torch.channels_last)
        xb = x.to(dtype).to(memory_format=torch.channels_last)
        try:
            run = _compiled(model, backend, args.fallback)
            time_it = _Timer(args.device)
            times, first, y = [], 0.0, None
            with torch.no_grad():
                for i in range(args.resnet_steps):
                    y, ms, wall = time_it(lambda: run(xb))
                    first = wall if i == 0 else first
                    if i >= args.warmup:
                        times.append(ms)
            error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
            rows.append(_row(label, backend, times, first, f"rel. error vs fp32 {error:.2e}", _peak(args.device)))
            if args.profile and args.device == "cuda":
                with torch.no_grad():
                    _kernel_profile(f"{label} / {backend}", lambda: run(xb), 3, args.profile)
            with torch.no_grad():
                _host_and_gaps(args, f"{label} / {backend}", lambda: [lambda: run(xb)] * 6)
        except Exception:  # noqa: BLE001
            print(f"{label} / {backend} failed:\n{traceback.format_exc()}")
        del model
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="SDPA only, 20 GPT-2 steps, 10 resnet50 calls")
    p.add_argument("--tiny", action="store_true", help="the CPU tests' sizes (runs on the CPU too)")
    p.add_argument("--models", nargs="+", default=["gpt2", "resnet50"], choices=["gpt2", "resnet50"])
    p.add_argument("--backends", nargs="+", default=None, choices=list(BACKENDS))
    p.add_argument("--attention", nargs="+", default=None, choices=["eager", "sdpa"])
    p.add_argument("--fallback", default="error", choices=["error", "aten"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each backend's timing, a few calls under torch.profiler: GPU busy time against "
                        "the call's time and the top N kernels")
    p.add_argument("--host", type=int, default=0, metavar="N",
                   help="also the host's top N Python functions by time over 3 steps (cProfile)")
    p.add_argument("--gaps", type=int, default=0, metavar="N",
                   help="also the GPU's idle time within 3 steps (each synchronized) and its N longest gaps")
    p.add_argument("--partitioner", default="recompute", choices=["min_cut", "default", "recompute"],
                   help="tecc's partitioner option for GPT-2 (what its forward saves for the backward)")
    p.add_argument("--memory-snapshot", default=None, metavar="DIR",
                   help="dump torch's allocation history of each backend's GPT-2 steps into DIR (pytorch.org/memory_viz)")
    args = p.parse_args()
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.tiny:
        sys.exit("benchmarks/models_hf.py needs a CUDA GPU (or --tiny for the small sizes on the CPU)")
    args.backends = args.backends or (list(BACKENDS) if args.device == "cuda" else ["eager", "tecc"])
    args.attention = args.attention or (["sdpa"] if args.quick else ["eager", "sdpa"])
    args.gpt2_steps = 20 if args.quick or args.tiny else 40
    args.resnet_steps = 10 if args.quick or args.tiny else 30
    if args.tiny:
        args.gpt2_steps, args.resnet_steps, args.warmup = 4, 3, 1
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (tecc in the emulator)"
    probe = f", host probe {_host_probe():.1f} us per eager launch" if args.device == "cuda" else ""
    lines = [f"{device}, torch {torch.__version__}{probe}", "",
             "| model | backend | ms (median) | first call s | error | peak GiB |", "| --- | --- | --- | --- | --- | --- |"]
    # torchvision first: transformers imports it when it is installed
    torchvision = _package("torchvision") if "resnet50" in args.models or "gpt2" in args.models else None
    if "gpt2" in args.models:
        transformers = _package("transformers")
        if transformers is not None:
            print(f"transformers {transformers.__version__}")
            lines += gpt2(args, transformers)
    if "resnet50" in args.models and torchvision is not None:
        lines += resnet50(args, torchvision)
    from tecc.torch.report import reports

    fallen = sorted({op for r in reports() for op in r.fallback_ops})
    lines += ["", f"tecc fallbacks: {', '.join(fallen) if fallen else 'none'}"]
    from models import graph_totals  # benchmarks/models.py

    lines += [f"tecc CUDA graphs of repeated calls (all runs of this process): {graph_totals()}"]
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
