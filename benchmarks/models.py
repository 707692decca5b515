"""Whole models through torch.compile: eager, inductor and tecc side by side (docs/models.md).

    python benchmarks/models.py                          # GPT-2 small training step, both attention forms,
                                                         #   then resnet50 inference if torchvision imports
    python benchmarks/models.py --models gpt2 --attention sdpa --steps 20 --out results/models.md
    python benchmarks/models.py --layers 2 --steps 5     # a quick look
    python benchmarks/models.py --quick                  # GPT-2 small (SDPA) and the conv net, 6 steps, the three
                                                         #   backends, tecc's compile in a second process (~4-6 min)
    python benchmarks/models.py --models gpt2 --attention sdpa --backends tecc --steps 3 --warmup 1 --aot-cache
                                                         # the second process without, then with aot_cache

GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50304, batch 8 x 1024 tokens, bf16
autocast, AdamW outside the compiled model (lr 1e-4), dropout 0. For each backend the model
starts from the same weights and sees the same batches; a step is forward + backward +
optimizer step, timed with CUDA events; the median over the steps after --warmup is reported
with the first call's time (the compile). The loss table shows each backend's loss per step and
the largest |loss - eager loss| (the acceptance bound for tecc is 2e-2 at dropout 0).

convnet (--models convnet, no torchvision needed): a ResNet stem and three padded 3x3 64 -> 64
layers at 56 x 56, batch 32, measured as resnet50 below.

resnet50: torchvision.models.resnet50() (random weights), eval, bf16, channels_last, batch 32,
224 x 224: median inference time and the relative error of each backend against eager in
float32 (max |y - y_fp32| / max |y_fp32|; the bound for tecc is 3e-2, inductor's is about 1.1e-2).

transformers' GPT2LMHeadModel(GPT2Config()) (--models hf-gpt2: its "eager" and "sdpa" attention,
random weights, the same training step) runs where transformers imports; resnet50 where
torchvision does; each is skipped with a message otherwise.

After tecc's GPT-2 run, a second process compiles the same model with the same TECC_CACHE_DIR
(the graph cache on disk, docs/cache.md) and reports its first call (compile + one step): the
issue's bound is 3 s for the compile (--no-second-process skips it); after inductor's run, the
same for inductor (its FX graph cache and AOTAutograd cache, filled by its run), the reference.
The first step is split into the host's forward call, its backward call and the rest (the
optimizer's first step, the wait for the GPU). tecc's option `aot_cache` is
on by default (AOTAutograd's cache holds its result: the second process skips the joint trace and
the partitioner, tecc/torch/aot_cache.py; its phases include AOTAutograd's cache counters, a hit
is "AOTAutograd cache hit (count) 1.00"; where tecc's own entry skips AOTAutograd altogether,
tecc/torch/direct.py, no AOTAutograd counter moves and "tecc direct entries used" counts it); --aot-cache also runs the second process without it
first, --no-aot-cache runs tecc with options={"aot_cache": False} throughout. A backend that
fails is a row with its error, and the others still run.

tecc runs with fallback="aten" unless --strict (fallback="error"); the ops that fell back are
listed. --tecc-cudagraphs adds options={"cudagraphs": True} (each compiled graph replayed whole
as one CUDA graph, its inputs copied in: docs/models.md). Rows are printed as markdown and, with --out, written to a file for RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

from train_gpt import GPT  # noqa: E402

BACKENDS = ("eager", "inductor", "tecc")


# options every tecc compile of this process adds (--tecc-cudagraphs)
TECC_OPTIONS: dict[str, object] = {}


def _compiled(model, backend: str, strict: bool, aot_cache: bool = True):
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model)
    options = {"fallback": "error" if strict else "aten", **TECC_OPTIONS}
    if not aot_cache:   # on by default (the backend's option)
        options["aot_cache"] = False
    return torch.compile(model, backend="tecc", options=options)


def _batches(steps: int, batch: int, context: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, context), generator=g).cuda(),
             torch.randint(0, vocab, (batch, context), generator=g).cuda()) for _ in range(steps)]


def _train(run, model, data, warmup: int) -> tuple[float, float, list[float], float]:
    """(median step ms after warmup, first call s, losses, the first step's peak of allocated GPU
    memory in GiB: the weights, the optimizer's state made at its first step, the activations the
    forward saves, the backward's) of AdamW steps under bf16 autocast."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses, times = [], []
    first = peak = None
    torch.cuda.reset_peak_memory_stats()
    for step, (idx, targets) in enumerate(data):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        wall = time.perf_counter()
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if first is None:
            first = time.perf_counter() - wall
            peak = torch.cuda.max_memory_allocated() / 2**30
        if step >= warmup:
            times.append(start.elapsed_time(end))
        losses.append(loss.item())
    nan = float("nan")
    return (statistics.median(times) if times else nan), first or nan, losses, nan if peak is None else peak


def _compare(label: str, base, data, args: argparse.Namespace) -> list[str]:
    """One row per backend for the model `base` (each from a copy of its weights)."""
    results: dict[str, tuple[float, float, list[float], float]] = {}
    rows = []
    for backend in args.backends:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        try:
            results[backend] = _train(_compiled(model, backend, args.strict, args.aot_cache), model, data, args.warmup)
        except Exception as exc:  # noqa: BLE001 - a failing backend is reported, the others still run
            message = str(exc).strip().splitlines()
            rows.append(f"| {label} | {backend} | failed: {type(exc).__name__}: {message[0][:160] if message else ''} "
                        "| | | |")
        del model
        torch.cuda.empty_cache()
    eager = results.get("eager")
    for backend, (ms, first, losses, _) in results.items():
        diff = max(abs(a - b) for a, b in zip(losses, eager[2])) if eager else float("nan")
        rows.append(f"| {label} | {backend} | {ms:.1f} | {first:.1f} | {losses[-1]:.4f} | {diff:.2e} |")
    print(f"\n{label}: peak GiB of the first step (training only, this process): "
          + ", ".join(f"{b} {r[3]:.2f}" for b, r in results.items()))
    print(f"\nlosses per step ({label}):")
    print("step " + " ".join(f"{b:>10s}" for b in results))
    for step in range(len(data)):
        print(f"{step:4d} " + " ".join(f"{results[b][2][step]:10.4f}" for b in results))
    return rows


HEADER = ["| model | backend | step ms (median) | first call s (compile + step) | last loss | max |Δloss| vs eager |",
          "| --- | --- | --- | --- | --- | --- |"]


def gpt2(args: argparse.Namespace) -> list[str]:
    vocab, width, heads, context, batch = 50304, 768, 12, 1024, 8
    rows = []
    for attention in args.attention:
        torch.manual_seed(0)
        base = GPT(vocab, width, heads, args.layers, context, attention).cuda()
        data = _batches(args.steps, batch, context, vocab)
        rows += _compare(f"gpt2 {args.layers}L {attention}", base, data, args)
        if "tecc" in args.backends and args.second_process:
            if args.compare_aot_cache and args.aot_cache:  # the same second process without the option first
                rows.append(_second_process(attention, args, aot_cache=False))
            rows.append(_second_process(attention, args, aot_cache=args.aot_cache))
        if "inductor" in args.backends and args.second_process:  # the reference: inductor's caches hit
            rows.append(_second_process(attention, args, aot_cache=True, backend="inductor"))
    return HEADER + rows


def _second_process(attention: str, args: argparse.Namespace, aot_cache: bool, backend: str = "tecc") -> str:
    """`backend`'s first call in a new process that finds the compiled graphs in the disk cache
    (tecc's and, with `aot_cache`, AOTAutograd's result in torch's cache: no joint trace, no
    partitioner; inductor's FX graph cache and AOTAutograd cache, filled by this process's run)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child-compile", attention, "--layers",
               str(args.layers), "--child-backend", backend] + (["--strict"] if args.strict else []) \
        + ([] if aot_cache else ["--no-aot-cache"]) + (["--tecc-cudagraphs"] if args.tecc_cudagraphs else []) \
        + (["--tecc-partitioner", args.tecc_partitioner] if args.tecc_partitioner else [])
    if args.profile_second_process and backend == "tecc":
        command += ["--profile-second-process", args.profile_second_process]
    what = f"{backend}, second process (disk cache" + (" + AOTAutograd's cache)" if aot_cache else ")")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    process = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return f"| gpt2 {args.layers}L {attention} | {what} | failed: {tail[0][:160]} | | | |"
    found = json.loads(lines[-1])
    print(f"\n{what} (gpt2 {args.layers}L {attention}), seconds: whole process {process:.1f}; "
          + "; ".join(f"{name} {seconds:.2f}" for name, seconds in found["phases"].items()))
    if args.profile_second_process and backend == "tecc":
        import pstats

        print(f"its first step under cProfile ({args.profile_second_process}), the top 40 by cumulative time:")
        pstats.Stats(args.profile_second_process).sort_stats("cumulative").print_stats(40)
    return (f"| gpt2 {args.layers}L {attention} | {what} | | {found['first']:.1f} | "
            f"{found['loss']:.4f} | |")


# dynamo's timers (torch._dynamo.utils.compile_times) that split a second process's first call
DYNAMO_PHASES = {"bytecode_tracing": "dynamo tracing", "create_aot_dispatcher_function": "AOTAutograd (forward)",
                 "aot_trace_joint_graph": "  of which the joint trace", "backward._backward_impl": "first backward call"}


def _child_compile(attention: str, args: argparse.Namespace) -> None:
    """The second process: its first step, split into phases (printed as JSON): `torch.compile`
    (tecc imported through the entry point), dynamo's timers (DYNAMO_PHASES; the AOTAutograd
    forward phase includes tecc's load of the forward graph, the first backward call its load
    of the backward graph and that backward's run) and tecc's own load of each graph from the
    disk cache (its report's seconds)."""
    from torch._dynamo.utils import compile_times

    torch.manual_seed(0)
    vocab, width, heads, context, batch = 50304, 768, 12, 1024, 8
    model = GPT(vocab, width, heads, args.layers, context, attention).cuda()
    data = _batches(1, batch, context, vocab)
    start = time.perf_counter()
    compiled = _compiled(model, args.child_backend, args.strict, args.aot_cache)
    phases = {f"torch.compile (imports {args.child_backend})": time.perf_counter() - start}
    if args.child_backend == "tecc":
        phases["AOTAutograd's partitioner"] = 0.0  # its first call imports torch._inductor (the min-cut's CSE pass)
        _time_partitioner(phases, "AOTAutograd's partitioner")
    compiled = _split_first_step(compiled, phases)
    profile = None
    if args.profile_second_process:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    _, first, losses, peak = _train(compiled, model, data, 1)
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile_second_process)
    phases["first step"] = first
    phases["peak GiB of the first step"] = peak
    phases["  of which the optimizer step and the synchronize"] = first - phases["  of which the forward call"] \
        - phases["  of which the backward call"]
    names, seconds = compile_times(repr="csv", aggregate=True)
    timers = dict(zip(names, seconds))
    phases.update({label: float(timers[name]) for name, label in DYNAMO_PHASES.items() if name in timers})
    if args.child_backend == "tecc":
        from tecc.torch.report import reports

        phases.update({f"tecc load {r.name}": r.seconds for r in reports()})
        from tecc.torch import direct

        phases["tecc direct entries used (count)"] = float(direct.STATS["hits"])
    from torch._dynamo.utils import counters

    phases.update({f"AOTAutograd cache {k.removeprefix('autograd_cache_')} (count)": float(v)
                   for k, v in counters["aot_autograd"].items()})
    print(json.dumps({"first": first, "loss": losses[0], "phases": phases}))


def _split_first_step(compiled, phases: dict[str, float]):
    """`compiled` whose first call records the seconds until the forward returns and until the
    loss's backward returns (both asynchronous on the GPU: what the host spent) in phases."""
    calls = []

    def run(idx, targets):
        start = time.perf_counter()
        loss = compiled(idx, targets)
        if not calls:
            calls.append(True)
            phases["  of which the forward call"] = time.perf_counter() - start
            original = loss.backward

            def backward(*a, **kw):
                begin = time.perf_counter()
                original(*a, **kw)
                phases["  of which the backward call"] = time.perf_counter() - begin
            loss.backward = backward
        return loss
    return run


def _time_partitioner(phases: dict[str, float], label: str) -> None:
    """Add the seconds of the backend's partition_fn (AOTAutograd's partitioner) to phases[label]."""
    from tecc.torch import backend

    chosen = backend.partition

    def timed_partition(name: str) -> dict:
        found = chosen(name)
        inner = found.get("partition_fn")
        if inner is None:
            return found

        def partition_fn(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                phases[label] += time.perf_counter() - start

        return {**found, "partition_fn": partition_fn}

    backend.partition = timed_partition


def hf_gpt2(args: argparse.Namespace) -> list[str]:
    try:
        import transformers
    except ImportError:
        print("transformers is not importable: hf-gpt2 skipped")
        return []
    rows = []
    for implementation in ("eager", "sdpa"):
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=args.layers, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        try:
            base = transformers.GPT2LMHeadModel(config, attn_implementation=implementation).cuda()
        except (TypeError, ValueError) as exc:
            print(f"hf-gpt2 {implementation}: {exc}")
            continue

        class Loss(torch.nn.Module):
            def __init__(self, inner) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, idx, targets):
                return self.inner(input_ids=idx, labels=targets).loss

        data = _batches(args.steps, 8, 1024, config.vocab_size)
        rows += _compare(f"hf GPT2LMHeadModel {args.layers}L {implementation}", Loss(base), data, args)
    return HEADER + rows if rows else []


def _inference(label: str, base, x, args: argparse.Namespace) -> list[str]:
    """One row per backend: bf16 channels_last inference of `base` (eval) against float32 eager."""
    with torch.no_grad():
        reference = base(x).float()
    rows = []
    for backend in args.backends:
        torch._dynamo.reset()
        model = copy.deepcopy(base).to(torch.bfloat16).to(memory_format=torch.channels_last)
        xb = x.to(torch.bfloat16).to(memory_format=torch.channels_last)
        times, first = [], None
        try:
            run = _compiled(model, backend, args.strict, args.aot_cache)
            with torch.no_grad():
                for step in range(args.steps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    wall = time.perf_counter()
                    start.record()
                    y = run(xb)
                    end.record()
                    torch.cuda.synchronize()
                    if first is None:
                        first = time.perf_counter() - wall
                    if step >= args.warmup:
                        times.append(start.elapsed_time(end))
        except Exception as exc:  # noqa: BLE001 - a failing backend is reported, the others still run
            message = str(exc).strip().splitlines()
            rows.append(f"| {label} | {backend} | failed: {type(exc).__name__}: {message[0][:160] if message else ''} | | |")
            continue
        error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
        median = statistics.median(times) if times else float("nan")
        rows.append(f"| {label} | {backend} | {median:.2f} | {first:.1f} | {error:.2e} |")
    return rows


INFERENCE_HEADER = ["| model | backend | inference ms (median) | first call s | rel. error vs fp32 |",
                    "| --- | --- | --- | --- | --- |"]


def resnet50(args: argparse.Namespace) -> list[str]:
    try:
        import torchvision
    except ImportError:
        print("torchvision is not importable: resnet50 skipped")
        return []
    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().eval()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    return INFERENCE_HEADER + _inference("resnet50 bf16 b32", base, x, args)


def convnet(args: argparse.Namespace) -> list[str]:
    """A ResNet stem and three padded 3x3 64 -> 64 layers at 56x56 (conv, batch norm, relu, max
    pool, adaptive average pool, linear), batch 32, bf16 channels_last: the convolution path
    without torchvision."""
    from torch import nn

    def block(cin: int, cout: int, **kw) -> list:
        bn = nn.BatchNorm2d(cout)
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        return [nn.Conv2d(cin, cout, bias=False, **kw), bn, nn.ReLU()]

    torch.manual_seed(0)
    layers = block(3, 64, kernel_size=7, stride=2, padding=3) + [nn.MaxPool2d(3, 2, 1)]
    for _ in range(3):
        layers += block(64, 64, kernel_size=3, padding=1)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 1000)]
    base = nn.Sequential(*layers).cuda().eval()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    return INFERENCE_HEADER + _inference("convnet (stem + 3x 3x3 64, 56x56) bf16 b32", base, x, args)


def graph_totals() -> str:
    """The runtime's CUDA-graph counts (tecc/runtime/graphs.py TOTALS), or why there are none
    (benchmarks/models_hf.py prints them too)."""
    try:
        from tecc.runtime.graphs import TOTALS
    except ImportError as exc:
        return f"unavailable ({exc})"
    return str(TOTALS)


def main() -> None:
    from tecc.torch.backend import PARTITIONERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "hf-gpt2", "resnet50", "convnet"],
                   choices=["gpt2", "hf-gpt2", "resnet50", "convnet"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--attention", nargs="+", default=["masked", "sdpa"], choices=["masked", "sdpa"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="GPT-2 small with SDPA and the conv net only, 6 steps (2 warm-up), and the second process")
    p.add_argument("--strict", action="store_true", help="tecc with fallback='error'")
    p.add_argument("--tecc-cudagraphs", action="store_true",
                   help="tecc with options={'cudagraphs': True}: each compiled graph captured whole (docs/models.md)")
    p.add_argument("--tecc-partitioner", default=None, choices=PARTITIONERS,
                   help="tecc with options={'partitioner': ...} (docs/models.md)")
    p.add_argument("--no-second-process", dest="second_process", action="store_false",
                   help="skip the second process that loads tecc's compiled graphs from the disk cache")
    p.add_argument("--aot-cache", dest="compare_aot_cache", action="store_true",
                   help="the second process also without tecc's option aot_cache (on by default), first")
    p.add_argument("--no-aot-cache", dest="aot_cache", action="store_false",
                   help="tecc with options={'aot_cache': False} (the first and the second process)")
    p.add_argument("--profile-second-process", default=None, metavar="FILE",
                   help="run the second process's first step under cProfile, write its stats to FILE and print "
                        "the top entries (the step's time is then the profiled one)")
    p.add_argument("--child-compile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-backend", default="tecc", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="also write the markdown rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/models.py needs a CUDA GPU")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.tecc_cudagraphs:
        TECC_OPTIONS["cudagraphs"] = True
    if args.tecc_partitioner:
        TECC_OPTIONS["partitioner"] = args.tecc_partitioner
    if args.child_compile:
        _child_compile(args.child_compile, args)
        return
    if args.quick:
        args.models, args.attention, args.steps, args.warmup = ["gpt2", "convnet"], ["sdpa"], 6, 2
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    if "gpt2" in args.models:
        lines += gpt2(args) + [""]
    if "hf-gpt2" in args.models:
        lines += hf_gpt2(args) + [""]
    if "resnet50" in args.models:
        lines += resnet50(args) + [""]
    if "convnet" in args.models:
        lines += convnet(args)
    from tecc.torch.report import reports

    fallen = sorted({op for r in reports() for op in r.fallback_ops})
    lines += ["", f"tecc fallbacks: {', '.join(fallen) if fallen else 'none'}"]
    lines += [f"tecc CUDA graphs of repeated calls (all runs of this process): {graph_totals()}"]
    from tecc.torch import background

    lines += [f"tecc graphs compiled by a worker process (option parallel_compile): {background.STATS}"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
