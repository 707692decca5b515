"""GPT-2 small's training step under inductor and tecc in alternating rounds of one process.

    python benchmarks/step_rounds.py                          # 6 rounds of 5 steps each
    python benchmarks/step_rounds.py --variants TECC_RELAUNCH=0 --rounds 8
    python benchmarks/step_rounds.py --partitioners min_cut recompute

The host's speed drifts within a process and differs between machine instances by 20% and more
(inductor's step measured 22.0 and 27.3 ms on two H200 hosts), so a ratio taken from two blocks
of steps run one after the other carries that drift. Here every backend (and each tecc variant,
an environment knob that tecc reads per call: `--variants NAME=VALUE ...`; each partitioner of
`--partitioners`, a model of its own compiled with that option) runs `--steps` steps
in turn, round after round; the median of each one's steps (CUDA events around a synchronized
step, as benchmarks/models.py times them: forward under bf16 autocast, backward, AdamW) and
its rounds' medians are printed, with the ratios against inductor. Each backend trains its own
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
    args = p.parse_args()

    torch.manual_seed(0)
    base = GPT(50304, 768, args.layers, 12, 1024, args.attention).cuda()
    data = _batches(args.warmup + args.rounds * args.steps, 8, 1024, 50304)
    runs = {}
    tecc_runs = ["tecc"] if len(args.partitioners) == 1 else [f"tecc partitioner={p}" for p in args.partitioners]
    for backend in ("inductor", *tecc_runs):
        model = copy.deepcopy(base)
        partitioner = backend.partition("=")[2] or args.partitioners[0]
        compiled = torch.compile(model) if backend == "inductor" else \
            torch.compile(model, backend="tecc", options={"fallback": "aten", "partitioner": partitioner})
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

    for backend in runs:  # compile and warm up
        for idx, targets in data[: args.warmup]:
            _step(*runs[backend], idx, targets)
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
    print("\n| backend | step ms (median of all steps) | rounds' medians | vs inductor |")
    print("| --- | --- | --- | --- |")
    ref = statistics.median([t for rnd in times["inductor"] for t in rnd])
    for label in labels:
        every = [t for rnd in times[label] for t in rnd]
        med = statistics.median(every)
        rounds = " / ".join(f"{statistics.median(rnd):.2f}" for rnd in times[label])
        print(f"| {label} | {med:.2f} | {rounds} | {ref / med:.3f}x |")
    print("\nlast losses (each backend trains its own copy; tecc's knob variants share tecc's):",
          ", ".join(f"{k} {v:.4f}" for k, v in losses.items()))


if __name__ == "__main__":
    main()
