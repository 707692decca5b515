"""A fused MLP block, Y = gelu(X W1 + b1) W2 + b2 + X, trained for a few steps with gradients
from tc.grad, next to the same block in plain torch from the same initial weights
(docs/pytorch.md). Runs on the GPU when torch has CUDA, else in tecc's CPU emulator; exits
non-zero when the two losses part.

    python docs/examples/pytorch_mlp.py
"""

from __future__ import annotations

import math
import secrets

import torch

import tecc as tc

GELU_C = math.sqrt(2.0 / math.pi)


def gelu(v: tc.Expr) -> tc.Expr:
    """tanh-approximated GELU, torch.nn.functional.gelu(approximate="tanh")."""
    return 0.5 * v * (1.0 + tc.tanh(GELU_C * (v + 0.044715 * v * v * v)))


def mlp_block(d: int, hidden: int, dtype: str) -> tuple[list[tc.Tensor], tc.Tensor]:
    R = tc.var("R")  # the batch: any number of rows
    X = tc.placeholder((R, d), dtype, name="X")
    W1 = tc.placeholder((d, hidden), dtype, name="W1")
    b1 = tc.placeholder((hidden,), dtype, name="b1")
    W2 = tc.placeholder((hidden, d), dtype, name="W2")
    b2 = tc.placeholder((d,), dtype, name="b2")
    k, h = tc.reduce_axis(d, name="k"), tc.reduce_axis(hidden, name="h")
    H = tc.compute((R, hidden), lambda i, j: gelu(tc.sum(X[i, k] * W1[k, j], axis=k) + b1[j]), name="H")
    Y = tc.compute((R, d), lambda i, j: tc.sum(H[i, h] * W2[h, j], axis=h) + b2[j] + X[i, j], name="Y")
    return [X, W1, b1, W2, b2], Y


class Block(torch.nn.Module):
    """The block's weights; `forward` through the tecc op, or through torch when `op` is None."""

    def __init__(self, d: int, hidden: int, op: object = None) -> None:
        super().__init__()
        self.op = op
        self.W1 = torch.nn.Parameter(torch.randn(d, hidden) / math.sqrt(d))
        self.b1 = torch.nn.Parameter(torch.zeros(hidden))
        self.W2 = torch.nn.Parameter(torch.randn(hidden, d) / math.sqrt(hidden))
        self.b2 = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None:
            return self.op(x, self.W1, self.b1, self.W2, self.b2)
        hidden = torch.nn.functional.gelu(x @ self.W1 + self.b1, approximate="tanh")
        return hidden @ self.W2 + self.b2 + x


def main() -> None:
    on_gpu = torch.cuda.is_available()
    device, target = ("cuda", "cuda") if on_gpu else ("cpu", "sim")
    rows, d, hidden, steps = (512, 64, 256, 5) if on_gpu else (32, 16, 32, 3)

    inputs, Y = mlp_block(d, hidden, "float32")
    op = tc.torch.op([*inputs, Y], f"tecc_example::mlp_block_{secrets.token_hex(3)}",
                     grads=tc.grad(Y, inputs), target=target)

    torch.manual_seed(0)
    fused = Block(d, hidden, op).to(device)
    reference = Block(d, hidden).to(device)
    reference.load_state_dict(fused.state_dict())
    x = torch.randn(rows, d, device=device)
    goal = torch.sin(3 * x)  # something for the block to learn

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, reference)]
    print(f"{'step':>4}  {'tecc loss':>12}  {'torch loss':>12}   ({device}, {rows}x{d}, hidden {hidden})")
    for step in range(steps):
        losses = []
        for model, opt in zip((fused, reference), optimizers):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), goal)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"{step:>4}  {losses[0]:>12.6f}  {losses[1]:>12.6f}")
        if not math.isclose(losses[0], losses[1], rel_tol=1e-4, abs_tol=1e-6):
            raise SystemExit(f"step {step}: the tecc block's loss {losses[0]} differs from torch's {losses[1]}")
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p, dict(reference.named_parameters())[name], rtol=1e-4, atol=1e-5)
    print("the tecc block trains like the torch block")


if __name__ == "__main__":
    main()
