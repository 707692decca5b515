"""Whole models through torch.compile: eager, inductor and tecc side by side (docs/models.md).

    python benchmarks/models.py                          # GPT-2 small training step, both attention forms,
                                                         #   then resnet50 inference if torchvision imports
    python benchmarks/models.py --models gpt2 --attention sdpa --steps 20 --out results/models.md
    python benchmarks/models.py --layers 2 --steps 5     # a quick look

GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50304, batch 8 x 1024 tokens, bf16
autocast, AdamW outside the compiled model (lr 1e-4), dropout 0. For each backend the model
starts from the same weights and sees the same batches; a step is forward + backward +
optimizer step, timed with CUDA events; the median over the steps after --warmup is reported
with the first call's time (the compile). The loss table shows each backend's loss per step and
the largest |loss - eager loss| (the acceptance bound for tecc is 2e-2 at dropout 0).

resnet50: torchvision.models.resnet50() (random weights), eval, bf16, channels_last, batch 32,
224 x 224: median inference time and the relative error of each backend against eager in
float32 (max |y - y_fp32| / max |y_fp32|; the bound for tecc is 3e-2, inductor's is about 1.1e-2).

tecc runs with fallback="aten" unless --strict (fallback="error"); the ops that fell back are
listed. Rows are printed as markdown and, with --out, written to a file for RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "docs" / "examples"))

from train_gpt import GPT  # noqa: E402

BACKENDS = ("eager", "inductor", "tecc")


def _compiled(model, backend: str, strict: bool):
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model)
    return torch.compile(model, backend="tecc", options={"fallback": "error" if strict else "aten"})


def _batches(steps: int, batch: int, context: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, context), generator=g).cuda(),
             torch.randint(0, vocab, (batch, context), generator=g).cuda()) for _ in range(steps)]


def gpt2(args: argparse.Namespace) -> list[str]:
    torch.manual_seed(0)
    vocab, width, heads, context, batch = 50304, 768, 12, 1024, 8
    rows = []
    for attention in args.attention:
        base = GPT(vocab, width, heads, args.layers, context, attention).cuda()
        data = _batches(args.steps, batch, context, vocab)
        results = {}
        for backend in args.backends:
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            run = _compiled(model, backend, args.strict)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            losses, times = [], []
            first = None
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
                if step >= args.warmup:
                    times.append(start.elapsed_time(end))
                losses.append(loss.item())
            results[backend] = (statistics.median(times) if times else float("nan"), first, losses)
            del model, run, opt
            torch.cuda.empty_cache()
        eager = results.get("eager")
        for backend, (ms, first, losses) in results.items():
            diff = max(abs(a - b) for a, b in zip(losses, eager[2])) if eager else float("nan")
            rows.append(f"| gpt2 {args.layers}L {attention} | {backend} | {ms:.1f} | {first:.1f} | {losses[-1]:.4f} | "
                        f"{diff:.2e} |")
        print(f"\nlosses per step ({attention}):")
        print("step " + " ".join(f"{b:>10s}" for b in results))
        for step in range(args.steps):
            print(f"{step:4d} " + " ".join(f"{results[b][2][step]:10.4f}" for b in results))
    header = ["| model | backend | step ms (median) | first call s | last loss | max |Δloss| vs eager |",
              "| --- | --- | --- | --- | --- | --- |"]
    return header + rows


def resnet50(args: argparse.Namespace) -> list[str]:
    try:
        import torchvision
    except ImportError:
        print("torchvision is not importable: resnet50 skipped")
        return []
    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().eval()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    with torch.no_grad():
        reference = base(x).float()
    rows = ["| model | backend | inference ms (median) | first call s | rel. error vs fp32 |", "| --- | --- | --- | --- | --- |"]
    for backend in args.backends:
        torch._dynamo.reset()
        model = copy.deepcopy(base).to(torch.bfloat16).to(memory_format=torch.channels_last)
        xb = x.to(torch.bfloat16).to(memory_format=torch.channels_last)
        run = _compiled(model, backend, args.strict)
        times, first = [], None
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
        error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
        rows.append(f"| resnet50 bf16 b32 | {backend} | {statistics.median(times):.2f} | {first:.1f} | {error:.2e} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "resnet50"], choices=["gpt2", "resnet50"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--attention", nargs="+", default=["masked", "sdpa"], choices=["masked", "sdpa"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--strict", action="store_true", help="tecc with fallback='error'")
    p.add_argument("--out", default=None, help="also write the markdown rows here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/models.py needs a CUDA GPU")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    lines = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]
    if "gpt2" in args.models:
        lines += gpt2(args) + [""]
    if "resnet50" in args.models:
        lines += resnet50(args)
    from tecc.torch.report import reports

    fallen = sorted({op for r in reports() for op in r.fallback_ops})
    lines += ["", f"tecc fallbacks: {', '.join(fallen) if fallen else 'none'}"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
