"""The host's side of a GPT-2 training step under backend="tecc", phase by phase, without a
profiler (which slows the host more than the GPU and so shows gaps a plain run does not have).

    python benchmarks/step_host.py                     # GPT-2 small, 12 layers, 14 steps
    python benchmarks/step_host.py --layers 2 --steps 6 --drain --release
    python benchmarks/step_host.py --hf --fine --steps 8        # transformers' GPT-2, finer phases
    python benchmarks/step_host.py --hf --steps 8 --profile-first 40   # + cProfile of the forward's call

The model and step are benchmarks/models.py's (bf16 autocast, AdamW outside the compiled model,
batch 8 x 1024 tokens). Each step is synchronized before it starts, as models.py times it, and
prints: the step's time by CUDA events, the host's time until the step was submitted, and what
the runtime's phases took (wall time summed over their calls, wrapped around the methods):

- `compiled_graph_call`: tecc's CompiledGraph calls (the forward's and the backward's), and in
  them `RunProgram` (the output allocation and the program's call), `MakeView` (views made
  with torch's view ops), `RunAten` (the ops that run as ATen);
- `replay_planned`: the CUDA-graph path of a cached call (runtime/graphs.py), and in it
  `capture`, `patch`, `launch_graph`; the graph actions of the step (replay, capture, patch);
- the garbage collector's collections in the step (gc.callbacks) and their time;
- `first:` when the step's first compiled-graph call, first program call and first graph
  launch began and ended, from the step's start: how long the GPU waits for the forward's
  first kernel in a step that starts synchronized.

`--hf` takes transformers' GPT2LMHeadModel and benchmarks/models_hf.py's step instead (labels =
the inputs, the `recompute` partitioner); `--fine` adds the parts of a program's call
(`layouts_number`, `arguments`, `relaunch`, `replay`, `accepts`: the pointer checks);
`--profile-first N` profiles each step's first compiled-graph call (the forward's) from the
fourth step on with cProfile and prints its top N functions by own time.

`--drain` shuts the planner's compile-check thread pool down after the first step (what a
check still in flight would cost the steps); `--release` drops the process's planner rankings
(tecc.torch.backend.RANKINGS) and collects after the first step; `--freeze` moves every object
to the collector's permanent generation (gc.freeze) before the fourth step. With an empty
TECC_CACHE_DIR the first step compiles; with a filled one it loads.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

import torch  # noqa: E402

from model_profile import _step  # noqa: E402  (benchmarks/model_profile.py: the step)
from models import _batches  # noqa: E402  (benchmarks/models.py)
from train_gpt import GPT  # noqa: E402


class Phases:
    """Wall time and calls per label, from methods wrapped in place (`wrap`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        # per label: when its first call of the step began and ended, from `t0` (the step's start)
        self.first: dict[str, tuple[float, float]] = {}
        self.t0 = 0.0

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self.seconds[label] += end - start
                self.calls[label] += 1
                self.first.setdefault(label, (start - self.t0, end - self.t0))

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.first.clear()
        self.t0 = time.perf_counter()

    def line(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.2f} ms x{self.calls[k]}" for k, v in self.seconds.items())

    def firsts(self) -> str:
        """When the step's first compiled-graph call, first program call and first graph launch
        began and ended."""
        return ", ".join(f"{k} {a * 1e3:.2f}-{b * 1e3:.2f} ms" for k, (a, b) in self.first.items()
                         if k in ("compiled_graph_call", "RunProgram", "launch_graph"))


def instrument(phases: Phases, actions: list[str], fine: bool = False) -> None:
    from tecc.runtime import cuda, graphs, launch_cache
    from tecc.torch import runtime

    for name, label in (("_replay_planned", "replay_planned"), ("_patch", "patch"), ("_capture", "capture"),
                        ("_launch_graph", "launch_graph")):
        phases.wrap(graphs.GraphReplay, name, label)
    phases.wrap(runtime.CompiledGraph, "__call__", "compiled_graph_call")
    for cls in (runtime.RunProgram, runtime.RunAten, runtime.MakeView):
        phases.wrap(cls, "run", cls.__name__)
    if fine:   # --fine: the parts of a program's call
        phases.wrap(runtime.CompiledGraph, "_layouts_number", "layouts_number")
        phases.wrap(runtime.RunProgram, "_arguments", "arguments")
        phases.wrap(cuda.CudaExecutor, "relaunch", "relaunch")
        phases.wrap(cuda.CudaExecutor, "_replay", "replay")
        phases.wrap(launch_cache.CachedCall, "accepts", "accepts")
    plan: Callable[..., str] = graphs.CallGraphs.plan

    def planned(self: Any, key: Any, patching: bool) -> str:
        action = plan(self, key, patching)
        actions.append(action)
        return action

    graphs.CallGraphs.plan = planned  # type: ignore[method-assign]


def _profile_first_calls() -> dict[str, Any]:
    """Wrap CompiledGraph.__call__ so that, while `state["on"]`, each step's first call runs
    under one cProfile profile (`state["profile"]`); `state["done"]` is reset per step."""
    import cProfile

    from tecc.torch import runtime

    state: dict[str, Any] = {"profile": cProfile.Profile(), "on": False, "done": False}
    inner = runtime.CompiledGraph.__call__

    def call(self: Any, args: Any) -> Any:
        if not state["on"] or state["done"]:
            return inner(self, args)
        state["done"] = True
        state["profile"].enable()
        try:
            return inner(self, args)
        finally:
            state["profile"].disable()

    runtime.CompiledGraph.__call__ = call  # type: ignore[method-assign]
    return state


def _gpt_step(layers: int) -> tuple[Callable[[Any, Any], Any], str]:
    model = GPT(50304, 768, 12, layers, 1024, "sdpa").cuda()
    run = torch.compile(model, backend="tecc", options={"fallback": "aten"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return (lambda idx, targets: _step(run, opt, idx, targets)), f"GPT-2 {layers}L sdpa"


def _hf_step(layers: int) -> tuple[Callable[[Any, Any], Any], str]:
    """transformers' GPT2LMHeadModel and benchmarks/models_hf.py's step (labels = the inputs)."""
    import transformers

    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
                                     n_layer=layers)
    model = transformers.GPT2LMHeadModel(config).cuda().train()
    run = torch.compile(model, backend="tecc", options={"fallback": "aten", "partitioner": "recompute"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(idx: Any, targets: Any) -> Any:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=idx, labels=idx).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, f"transformers GPT2LMHeadModel {layers}L sdpa"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--drain", action="store_true", help="shut the compile-check pool down after the first step")
    p.add_argument("--release", action="store_true", help="drop the planner's rankings after the first step")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() before the fourth step")
    p.add_argument("--hf", action="store_true",
                   help="transformers' GPT2LMHeadModel (models_hf.py's step) instead of models.py's GPT-2")
    p.add_argument("--profile-first", type=int, default=0, metavar="N",
                   help="cProfile each step's first compiled-graph call (the forward) from the fourth step on; "
                        "print the top N functions by own time at the end")
    p.add_argument("--fine", action="store_true",
                   help="also the parts of a program's call (layouts number, arguments, relaunch, replay, "
                        "pointer checks)")
    args = p.parse_args()
    phases, actions = Phases(), []
    instrument(phases, actions, args.fine)
    profiled = _profile_first_calls() if args.profile_first else None
    pauses: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(on_gc)
    torch.manual_seed(0)
    step, name = _hf_step(args.layers) if args.hf else _gpt_step(args.layers)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; {name}", flush=True)
    for i, (idx, targets) in enumerate(_batches(args.steps, 8, 1024, 50304 if not args.hf else 50257)):
        if i == 1 and args.drain:
            from tecc.compiler import realize

            start = time.perf_counter()
            if realize._POOL is not None:
                realize._POOL.shutdown(wait=True)
            print(f"the compile-check pool drained in {time.perf_counter() - start:.3f} s", flush=True)
        if i == 1 and args.release:
            import tecc.torch.backend as backend

            before = len(gc.get_objects())
            backend.__dict__.pop("RANKINGS", None)
            gc.collect()
            print(f"the rankings released: {before} -> {len(gc.get_objects())} objects", flush=True)
        if i == 3 and args.freeze:
            gc.collect()
            gc.freeze()
            print(f"gc.freeze(): {gc.get_freeze_count()} objects", flush=True)
        if profiled is not None:
            profiled["on"], profiled["done"] = i >= 3, False
        phases.clear()
        actions.clear()
        pauses.clear()
        torch.cuda.synchronize()
        wall = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(idx, targets)
        end.record()
        host = time.perf_counter() - wall
        torch.cuda.synchronize()
        generations = collections.Counter(g for g, _ in pauses)
        print(f"step {i}: {start.elapsed_time(end):.2f} ms (events), host until submitted {host * 1e3:.2f} ms; "
              f"graphs {actions}; {phases.line()}; first: {phases.firsts()}; gc {len(pauses)} collections "
              f"{sum(s for _, s in pauses) * 1e3:.2f} ms {dict(generations)}", flush=True)
    if profiled is not None:
        import pstats

        print(f"\n### the first compiled-graph call of steps 3-{args.steps - 1} (cProfile, own time)")
        pstats.Stats(profiled["profile"]).sort_stats("tottime").print_stats(args.profile_first)
    from tecc.runtime.graphs import TOTALS

    print(f"objects tracked by gc: {len(gc.get_objects())}; {TOTALS}", flush=True)


if __name__ == "__main__":
    main()
