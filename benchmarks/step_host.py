"""The host's side of a GPT-2 training step under backend="tecc", phase by phase, without a
profiler (which slows the host more than the GPU and so shows gaps a plain run does not have).

    python benchmarks/step_host.py                     # GPT-2 small, 12 layers, 14 steps
    python benchmarks/step_host.py --layers 2 --steps 6 --drain --release

The model and step are benchmarks/models.py's (bf16 autocast, AdamW outside the compiled model,
batch 8 x 1024 tokens). Each step is synchronized before it starts, as models.py times it, and
prints: the step's time by CUDA events, the host's time until the step was submitted, and what
the runtime's phases took (wall time summed over their calls, wrapped around the methods):

- `compiled_graph_call`: tecc's CompiledGraph calls (the forward's and the backward's), and in
  them `RunProgram` (the output allocation and the program's call), `MakeView` (views made
  with torch's view ops), `RunAten` (the ops that run as ATen);
- `replay_planned`: the CUDA-graph path of a cached call (runtime/graphs.py), and in it
  `capture`, `patch`, `launch_graph`; the graph actions of the step (replay, capture, patch);
- the garbage collector's collections in the step (gc.callbacks) and their time.

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

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def line(self) -> str:
        return ", ".join(f"{k} {v * 1e3:.2f} ms x{self.calls[k]}" for k, v in self.seconds.items())


def instrument(phases: Phases, actions: list[str]) -> None:
    from tecc.runtime import graphs
    from tecc.torch import runtime

    for name, label in (("_replay_planned", "replay_planned"), ("_patch", "patch"), ("_capture", "capture"),
                        ("_launch_graph", "launch_graph")):
        phases.wrap(graphs.GraphReplay, name, label)
    phases.wrap(runtime.CompiledGraph, "__call__", "compiled_graph_call")
    for cls in (runtime.RunProgram, runtime.RunAten, runtime.MakeView):
        phases.wrap(cls, "run", cls.__name__)
    plan: Callable[..., str] = graphs.CallGraphs.plan

    def planned(self: Any, key: Any, patching: bool) -> str:
        action = plan(self, key, patching)
        actions.append(action)
        return action

    graphs.CallGraphs.plan = planned  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--drain", action="store_true", help="shut the compile-check pool down after the first step")
    p.add_argument("--release", action="store_true", help="drop the planner's rankings after the first step")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() before the fourth step")
    args = p.parse_args()
    phases, actions = Phases(), []
    instrument(phases, actions)
    pauses: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(on_gc)
    torch.manual_seed(0)
    model = GPT(50304, 768, 12, args.layers, 1024, "sdpa").cuda()
    run = torch.compile(model, backend="tecc", options={"fallback": "aten"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; GPT-2 {args.layers}L sdpa", flush=True)
    for i, (idx, targets) in enumerate(_batches(args.steps, 8, 1024, 50304)):
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
        phases.clear()
        actions.clear()
        pauses.clear()
        torch.cuda.synchronize()
        wall = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _step(run, opt, idx, targets)
        end.record()
        host = time.perf_counter() - wall
        torch.cuda.synchronize()
        generations = collections.Counter(g for g, _ in pauses)
        print(f"step {i}: {start.elapsed_time(end):.2f} ms (events), host until submitted {host * 1e3:.2f} ms; "
              f"graphs {actions}; {phases.line()}; gc {len(pauses)} collections "
              f"{sum(s for _, s in pauses) * 1e3:.2f} ms {dict(generations)}", flush=True)
    from tecc.runtime.graphs import TOTALS

    print(f"objects tracked by gc: {len(gc.get_objects())}; {TOTALS}", flush=True)


if __name__ == "__main__":
    main()
