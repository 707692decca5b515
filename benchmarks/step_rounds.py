"""GPT-2 small's training step under inductor and tecc in alternating rounds of one process.

    python benchmarks/step_rounds.py                          # 6 rounds of 5 steps each
    python benchmarks/step_rounds.py --variants TECC_RELAUNCH=0 --rounds 8
    python benchmarks/step_rounds.py --partitioners min_cut recompute
    python benchmarks/step_rounds.py --option-sets memory_parts=True memory_parts=False

The host's speed drifts within a process and differs between machine instances by 20% and more
(inductor's step measured 22.0 and 27.3 ms on two H200 hosts), so a ratio taken from two blocks
of steps run one after the other carries that drift. Here every backend (and each tecc variant,
an environment knob that tecc reads per call: `--variants NAME=VALUE ...`; each partitioner of
`--partitioners`, and each set of backend options of `--option-sets`, a model of its own compiled
with those options) runs `--steps` steps
in turn, round after round; the median of each one's steps (CUDA events around a synchronized
step, as benchmarks/models.py times them: forward under bf16 autocast, backward, AdamW) and
its rounds' medians are printed, with the ratios against inductor, and each compiled model's
first-step peak: the most GPU memory allocated during its first step above what was allocated
before it (the step's activations, gradients, temporaries and AdamW's new state; the other
models' memory is not counted). Each backend trains its own
copy of the model on the same batches; the last losses are printed to show they agree.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

import torch  # noqa: E402

from model_profile import _step as train_step  # noqa: E402  (benchmarks/model_profile.py)
from models import _batches  # noqa: E402  (benchmarks/models.py)
from train_gpt import GPT  # noqa: E402

from tecc.torch.backend import PARTITIONERS, Options  # noqa: E402


def _option_set(text: str) -> dict[str, object]:
    """"k=v,k=v" as backend options (True / False as booleans)."""
    options: dict[str, object] = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        options[key] = {"True": True, "False": False}.get(value, value)
    return options


def _step(run, opt, idx, targets) -> tuple[float, float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    loss = train_step(run, opt, idx, targets)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="steps per backend per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", default="sdpa", choices=["masked", "sdpa"])
    p.add_argument("--variants", nargs="*", default=[], help="tecc variants, each NAME=VALUE of an environment knob")
    p.add_argument("--partitioners", nargs="+", default=[Options.parse(None).partitioner], choices=PARTITIONERS,
                   help="tecc's partitioner option, a compiled model for each (default: the backend's default; "
                        "the first is the one the --variants run)")
    p.add_argument("--option-sets", nargs="+", default=None, metavar="K=V[,K=V]",
                   help="instead of --partitioners: sets of tecc backend options, a compiled model for each "
                        "(values True / False are booleans)")
    args = p.parse_args()
    option_sets = [_option_set(s) for s in args.option_sets] if args.option_sets else \
        [{"partitioner": partitioner} for partitioner in args.partitioners]

    torch.manual_seed(0)
    base = GPT(50304, 768, args.layers, 12, 1024, args.attention).cuda()
    data = _batches(args.warmup + args.rounds * args.steps, 8, 1024, 50304)
    runs = {}
    tecc_runs = ["tecc"] if len(option_sets) == 1 else \
        ["tecc " + ",".join(f"{k}={v}" for k, v in options.items()) for options in option_sets]
    for backend, options in (("inductor", None), *zip(tecc_runs, option_sets)):
        model = copy.deepcopy(base)
        compiled = torch.compile(model) if options is None else \
            torch.compile(model, backend="tecc", options={"fallback": "aten", **options})
        runs[backend] = (compiled, torch.optim.AdamW(model.parameters(), lr=1e-4))
    labels = ["inductor", *tecc_runs, *[f"tecc {v}" for v in args.variants]]
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; GPT-2 {args.layers}L {args.attention}, "
          f"{args.rounds} rounds of {args.steps} steps per backend")

    def run_as(label: str, idx, targets) -> tuple[float, float]:
        if label in runs:
            return _step(*runs[label], idx, targets)
        name, _, value = label[5:].partition("=")   # a knob variant of the first tecc model
        with mock.patch.dict(os.environ, {name: value}):
            return _step(*runs[tecc_runs[0]], idx, targets)

    peaks: dict[str, float] = {}
    for backend in runs:  # compile and warm up
        for number, (idx, targets) in enumerate(data[: args.warmup]):
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(*runs[backend], idx, targets)
            if number == 0:  # the first step: no optimizer state yet, no memory kept from a step before
                peaks[backend] = (torch.cuda.max_memory_allocated() - before) / 2**30
    times: dict[str, list[list[float]]] = {label: [] for label in labels}
    losses: dict[str, float] = {}
    batches = data[args.warmup:]
    for r in range(args.rounds):
        for label in labels:
            own = []
            for idx, targets in batches[r * args.steps:(r + 1) * args.steps]:
                ms, loss = run_as(label, idx, targets)
                own.append(ms)
            times[label].append(own)
            losses[label] = loss
    print("\n| backend | step ms (median of all steps) | rounds' medians | vs inductor | first step's peak GiB |")
    print("| --- | --- | --- | --- | --- |")
    ref = statistics.median([t for rnd in times["inductor"] for t in rnd])
    for label in labels:
        every = [t for rnd in times[label] for t in rnd]
        med = statistics.median(every)
        rounds = " / ".join(f"{statistics.median(rnd):.2f}" for rnd in times[label])
        peak = f"{peaks[label]:.2f}" if label in peaks else ""
        print(f"| {label} | {med:.2f} | {rounds} | {ref / med:.3f}x | {peak} |")
    print("\nlast losses (each backend trains its own copy; tecc's knob variants share tecc's):",
          ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))


if __name__ == "__main__":
    main()
