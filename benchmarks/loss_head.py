"""A language model's loss head, forward + backward, through torch.compile per backend.

    python benchmarks/loss_head.py                          # cross-entropy alone on bf16 logits, 8192 x 50304
    python benchmarks/loss_head.py --mode head              # logits = x @ W^T under bf16 autocast, then the loss
    python benchmarks/loss_head.py --rows 8192 --vocab 50304 --backends eager inductor tecc tecc:default

"tecc" is the backend with its default options (partitioner "recompute", a min-cut variant:
the forward saves the bf16 logits and two row statistics, the backward recomputes the float32
cast); a backend
"tecc:NAME" is tecc with options={"partitioner": NAME} ("default": AOTAutograd's default
partitioner, which saves float32 log-probabilities: tecc/torch/backend.py).

--mode ce: F.cross_entropy(logits.float(), targets, ignore_index=-1) on bf16 logits that require
grad (GPT-2's loss after its lm_head, as the ATen graphs tecc gets from benchmarks/model_kernels.py
carry it: a float32 log-softmax over 50,304 columns, the NLL's mean over the targets kept, and the
backward's softmax-minus-one-hot cast back to bf16). --mode head adds the lm_head GEMM (x of
rows x 768, W of vocab x 768) under bf16 autocast, as in the model.

Every backend's loss and gradient are first checked against float64 (torch on the same operands)
within bf16's bound (2e-2 relative, the gradient by its norm). Then per backend: the median of
--reps CUDA-event timings of one forward + backward (gradients cleared between calls), and the
ratio to the fastest backend; then, per backend, the kernels of --profile steps by CUPTI
(torch.profiler: each kernel's device time per step, so the host's share of the step shows as
the difference). tecc's kernels for these graphs are listed by
`python benchmarks/model_kernels.py --model gpt2 --layers 1` (the rows whose FX nodes hold amax,
sum_1, div, sum_4).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import kernel_durations  # noqa: E402  (benchmarks/gemm.py)

IGNORE = -1


class CrossEntropy(torch.nn.Module):
    def forward(self, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), t, ignore_index=IGNORE)


class Head(torch.nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(vocab, width) * 0.02)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x @ self.w.t(), t, ignore_index=IGNORE)


def make(mode: str, rows: int, vocab: int, width: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    t[::97] = IGNORE
    if mode == "ce":
        logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 2).bfloat16().requires_grad_(True)
        return CrossEntropy(), [logits], t
    model = Head(vocab, width).cuda()
    x = torch.randn(rows, width, device="cuda", generator=g, requires_grad=True)
    return model, [x, model.w], t


def step(fn, leaves, t) -> torch.Tensor:
    for p in leaves:
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fn(leaves[0], t)
    loss.backward()
    return loss


def reference(mode: str, leaves, t):
    a = leaves[0].detach().double().requires_grad_(True)
    if mode == "ce":
        loss = F.cross_entropy(a, t, ignore_index=IGNORE)
        loss.backward()
        return loss.detach(), [a.grad]
    w = leaves[1].detach().bfloat16().double().requires_grad_(True)
    ab = a.detach().bfloat16().double().requires_grad_(True)
    loss = F.cross_entropy(ab @ w.t(), t, ignore_index=IGNORE)
    loss.backward()
    return loss.detach(), [ab.grad, w.grad]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ce", "head"], default="ce")
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--backends", nargs="+", default=["eager", "inductor", "tecc", "tecc:default"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--profile", type=int, default=3, help="steps timed kernel by kernel (0: none)")
    args = p.parse_args()
    model, leaves, t = make(args.mode, args.rows, args.vocab, args.width)
    want, grads = reference(args.mode, leaves, t)
    times: dict[str, float] = {}
    profiles: dict[str, str] = {}
    for backend in args.backends:
        torch._dynamo.reset()
        if backend == "eager":
            fn = model
        elif backend.startswith("tecc:"):
            fn = torch.compile(model, backend="tecc", options={"partitioner": backend.split(":", 1)[1]})
        else:
            fn = torch.compile(model, backend=backend)
        loss = step(fn, leaves, t)
        err = abs(loss.item() - want.item()) / abs(want.item())
        gerr = max(float((p.grad.double() - g).norm() / g.norm()) for p, g in zip(leaves, grads))
        ok = err <= 2e-2 and gerr <= 2e-2
        for _ in range(2):
            step(fn, leaves, t)
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(fn, leaves, t)
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3)
        times[backend] = statistics.median(samples)
        if args.profile:
            profiles[backend] = kernel_times(lambda: step(fn, leaves, t), args.profile)
        print(f"{backend:9s} {times[backend]:9.1f} us  loss rel err {err:.1e}, grad rel err {gerr:.1e}"
              + ("" if ok else "  CHECK FAILED"))
    best = min(times.values())
    print(f"# {args.mode}: {args.rows} x {args.vocab}" + (f", width {args.width}" if args.mode == "head" else ""))
    for backend, us in times.items():
        print(f"| {backend} | {us:.1f} us | {us / best:.2f}x the fastest |")
    for backend, table in profiles.items():
        print(f"\n## {backend}: kernels per step (CUPTI)\n{table}")


def kernel_times(run, steps: int) -> str:
    """Each kernel's device time per step over `steps` calls of `run`, as a table, busiest first."""
    kernels = kernel_durations(run, steps)
    busy = sum(sum(v) for v in kernels.values()) / steps
    lines = [f"busy {busy:.1f} us per step", "| us per step | launches | kernel |", "| --- | --- | --- |"]
    for name, durations in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {sum(durations) / steps:.1f} | {len(durations) / steps:.0f} | {name[:100]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
