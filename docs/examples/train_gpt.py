"""Train a GPT with torch.compile(backend="tecc") next to the same model in eager PyTorch, from the
same initial weights and batches, and print both losses step by step (docs/models.md).

    python docs/examples/train_gpt.py                 # a tiny GPT on CPU tensors: tecc's programs run
                                                      #   in the SIMT emulator (width 64, 2 layers, 16 tokens)
    python docs/examples/train_gpt.py --gpt2          # GPT-2 small on a GPU: 12 layers, width 768,
                                                      #   batch 8 x 1024 tokens, bf16 autocast, AdamW
    python docs/examples/train_gpt.py --attention sdpa --steps 20 --dump-ir dumps/gpt

    python docs/examples/train_gpt.py --gpt2 --attention sdpa --steps 5   # a quick GPU check (~1-2 min)

The optimizer runs outside the compiled model, as usual. The script exits non-zero when the
losses part by more than the tolerance (1e-4 in float32 on the CPU; 2e-2 under bf16 autocast).
It compiles with fallback="error" (every op lowered by tecc); --fallback aten runs the ops tecc
does not lower as ATen inside the compiled graphs, and logs them. The first step's tecc time
includes the compile of the forward and backward graphs.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attention: str) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # the masked_fill + softmax form
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
            y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int, attention: str) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads, attention) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt2", action="store_true", help="GPT-2 small on the GPU (default: the tiny GPT on the CPU)")
    p.add_argument("--attention", choices=("masked", "sdpa"), default="masked")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dump-ir", default=None, help="write each graph's dumps here")
    p.add_argument("--fallback", choices=("error", "aten"), default="error",
                   help="'error' (default): every op lowered by tecc, or the compile fails naming the op; "
                        "'aten': ops tecc cannot lower run as ATen inside the compiled graphs (logged)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    if args.gpt2:
        if not torch.cuda.is_available():
            print("--gpt2 needs a CUDA GPU", file=sys.stderr)
            return 2
        device, vocab, width, heads, layers, context, batch = "cuda", 50304, 768, 12, 12, 1024, 8
        steps, tolerance, autocast = 20, 2e-2, torch.bfloat16
    else:
        device, vocab, width, heads, layers, context, batch = "cpu", 128, 64, 4, 2, 16, 2
        steps, tolerance, autocast = 4, 1e-4, None
    steps = args.steps or steps
    layers = args.layers or layers

    torch.manual_seed(0)
    eager = GPT(vocab, width, heads, layers, context, args.attention).to(device)
    twin = copy.deepcopy(eager)
    options = {"fallback": args.fallback, **({"dump_ir": args.dump_ir} if args.dump_ir else {})}
    compiled = torch.compile(twin, backend="tecc", options=options)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, twin)]
    g = torch.Generator(device="cpu").manual_seed(1)

    print(f"step    eager loss     tecc loss    |diff|    tecc s   ({device}, {layers} layers, width {width}, "
          f"{batch}x{context} tokens, {args.attention} attention)")
    worst = 0.0
    for step in range(steps):
        idx = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        targets = torch.randint(0, vocab, (batch, context), generator=g).to(device)
        losses, seconds = [], 0.0
        for model, opt in zip((eager, compiled), optimizers):
            start = time.perf_counter()
            with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
                loss = model(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            seconds = time.perf_counter() - start
        diff = abs(losses[0] - losses[1])
        worst = max(worst, diff)
        print(f"{step:4d}  {losses[0]:12.6f}  {losses[1]:12.6f}  {diff:8.1e}  {seconds:8.2f}")
    if worst > tolerance:
        print(f"the losses parted: max |diff| {worst:.2e} > {tolerance:.0e}")
        return 1
    print(f"tecc trains like eager (max |diff| {worst:.1e} <= {tolerance:.0e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
