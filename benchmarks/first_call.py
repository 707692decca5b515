"""The first call of `torch.compile(model, backend="tecc")` on GPT-2 small, as a timeline (GPU).

    python benchmarks/first_call.py                       # one eager step (CUDA warm), then tecc's first step
    python benchmarks/first_call.py --checks              # also every compile check: kernel, seconds, outcome
    python benchmarks/first_call.py --parallel-compile off  # the forward compiled in this process, first
    python benchmarks/first_call.py --profile DIR         # a cProfile of each graph's tc.build into DIR

Where benchmarks/models.py reports a first call as one number, this prints when each part of it
happened, in seconds since the step began: dynamo's trace (until AOTAutograd is called), the
joint trace and partition (until the forward graph's compiler is called), each graph's compile
(until its compiler returns; the forward's returns at once when a worker compiles it), the
first forward, backward and optimizer step; tecc's own log lines (INFO) in between. For each
graph compiled here, the phases of its tc.build as benchmarks/compile_profile.py names them
(lowering, planner, of which compile checks summed over threads and the planner's wait for them,
fixed passes, emission, the final NVRTC). Unlike compile_profile.py, this is the compile of the
real process: the GPU's own ATen graphs (SDPA's CUDA attention ops), the worker compiling the
forward beside it, and whatever else the process holds.

The model is docs/examples/train_gpt.py's GPT at GPT-2 small's sizes (12 layers, width 768, 12
heads, vocabulary 50304, batch 8 x 1024 tokens, bf16 autocast, SDPA, AdamW). Set TECC_CACHE_DIR
to an empty folder (and remove torch's own cache folder, /tmp/torchinductor_$USER, for
AOTAutograd's cache) for a first compile; the same folder again gives the cache-hit path.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))
sys.path.insert(0, str(HERE))

VOCAB, WIDTH, HEADS, LAYERS, CONTEXT, BATCH = 50304, 768, 12, 12, 1024, 8


class Clock:
    """Seconds since the step began, printed with what happened."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def restart(self) -> None:
        self.start = time.perf_counter()

    def mark(self, what: str) -> None:
        print(f"{time.perf_counter() - self.start:7.2f} s  {what}", flush=True)


def _log_to(clock: Clock) -> None:
    """tecc's INFO log lines on stdout, on the clock."""

    class Since(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{time.perf_counter() - clock.start:7.2f} s  [tecc] {record.getMessage()}"

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(Since())
    log = logging.getLogger("tecc")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _wrap(module: Any, name: str, around: Any) -> None:
    inner = getattr(module, name)
    setattr(module, name, lambda *a, **k: around(inner, *a, **k))


def instrument(clock: Clock, checks: bool, profile: str | None) -> None:
    """Marks at AOTAutograd's entry and return, each graph compiler's call and return, and each
    graph's tc.build phases (compile_profile's counters); with `checks`, every compile check."""
    import importlib

    import compile_profile
    import torch._functorch.aot_autograd as aot

    backend = importlib.import_module("tecc.torch.backend")
    build = importlib.import_module("tecc.compiler.build")

    def aot_module(inner: Any, *a: Any, **k: Any) -> Any:
        clock.mark("dynamo's trace done: AOTAutograd called")
        out = inner(*a, **k)
        clock.mark("AOTAutograd returned")
        return out

    def graph_compiler(inner: Any, gm: Any, opts: Any, name: str, *a: Any, **k: Any) -> Any:
        clock.mark(f"compiler called: {name} ({len(gm.graph.nodes)} FX nodes)")
        out = inner(gm, opts, name, *a, **k)
        clock.mark(f"compiler returned: {name}")
        return out

    nvrtc = compile_profile._nvrtc_counter()
    wrapped = compile_profile._instrument()

    def build_programs(inner: Any, plan: Any, target: str, opts: Any, deterministic: bool) -> Any:
        phases = compile_profile.Phases()
        for w in wrapped:
            w.phases = phases
        before = list(nvrtc)
        profiler = None
        if profile is not None:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        try:
            kernels = phases.timed("tc.build (all programs)", inner, plan, target, opts, deterministic)
        finally:
            if profiler is not None:
                profiler.disable()
                Path(profile).mkdir(parents=True, exist_ok=True)   # type: ignore[arg-type]
                profiler.dump_stats(str(Path(profile) / f"{plan.name}.prof"))   # type: ignore[arg-type]
            for w in wrapped:
                w.phases = None
        compile_profile.add_build_phases(phases, kernels)
        print(f"         {plan.name}'s tc.build: NVRTC {nvrtc[1] - before[1]} compiles, {nvrtc[0] - before[0]:.1f} s "
              "(summed over threads); " + "; ".join(f"{n.strip()} {v:.2f} s" for n, v in phases.seconds.items() if v),
              flush=True)
        return kernels

    def check(inner: Any, schedule: Any, kernel: str | None, arch: str) -> Any:
        start, outcome = time.perf_counter(), "passed"
        try:
            return inner(schedule, kernel, arch)
        except Exception as exc:
            outcome = "refused: " + str(exc).splitlines()[0][:150]
            raise
        finally:
            steps = [s.primitive for s in schedule.plan.steps][-3:]
            print(f"         check {kernel or '(a graph rewrite, every kernel)'} {time.perf_counter() - start:.2f} s "
                  f"{outcome} | last steps {steps}", flush=True)

    _wrap(aot, "aot_module_simplified", aot_module)
    _wrap(backend, "_for_aot_cache", graph_compiler)
    _wrap(backend, "build_programs", build_programs)
    if checks:
        _wrap(build, "refuse_spills", check)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checks", action="store_true", help="print every compile check of the planner")
    p.add_argument("--parallel-compile", choices=("auto", "on", "off"), default="auto",
                   help="tecc's option parallel_compile (auto: the backend's default)")
    p.add_argument("--profile", default=None, metavar="DIR", help="a cProfile of each graph's tc.build into DIR")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("first_call.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from train_gpt import GPT

    clock = Clock()
    _log_to(clock)
    instrument(clock, args.checks, args.profile)
    torch.manual_seed(0)
    model = GPT(VOCAB, WIDTH, HEADS, LAYERS, CONTEXT, "sdpa").cuda()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g).cuda()
    targets = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = {} if args.parallel_compile == "auto" else {"parallel_compile": args.parallel_compile == "on"}
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, TECC_CACHE_DIR="
          f"{'set' if os.environ.get('TECC_CACHE_DIR') else 'default'}")
    for backend in ("eager", "tecc"):
        run = model if backend == "eager" else torch.compile(model, backend="tecc", options=options)
        clock.restart()
        clock.mark(f"{backend}: the first step begins")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(idx, targets)
        torch.cuda.synchronize()
        clock.mark("forward done")
        loss.backward()
        torch.cuda.synchronize()
        clock.mark("backward done")
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        clock.mark("optimizer step done: the first call")
    from tecc.torch import background

    print(f"graphs compiled by a worker (option parallel_compile): {background.STATS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
