"""Small models the torch.compile backend's tests train and run (tests/test_torch_backend.py,
tests/test_torch_ddp.py): a GPT with either attention form, an MLP and a conv net; and
`fresh_dynamo`, the autouse fixture of the backend's test modules (imported by each)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tecc.torch.report import clear_reports


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: dynamo's caches and tecc's compile reports cleared around it."""
    torch._dynamo.reset()
    clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture
def programs(monkeypatch):
    """The RunProgram steps of the graphs compiled in the test (import it where it is used)."""
    from tecc.torch import backend
    from tecc.torch.runtime import RunProgram

    found: list[RunProgram] = []
    assemble = backend.assemble

    def spy(*args, **kwargs):
        graph = assemble(*args, **kwargs)
        found.extend(s for s in graph.steps if isinstance(s, RunProgram))
        return graph

    monkeypatch.setattr(backend, "assemble", spy)
    return found


class Block(nn.Module):
    """A pre-norm transformer block; attention as masked_fill + softmax, or through SDPA."""

    def __init__(self, width: int, heads: int, attention: str, dropout: float) -> None:
        super().__init__()
        self.heads, self.attention, self.dropout = heads, attention, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
            att = F.dropout(F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1), self.dropout, self.training)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    """A GPT language model returning the mean cross-entropy of next-token targets."""

    def __init__(self, vocab: int = 128, width: int = 64, heads: int = 4, layers: int = 2, context: int = 16,
                 attention: str = "masked", dropout: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads, attention, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class MLP(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x)))) + x


class ConvNet(nn.Module):
    """conv, batch norm, relu, max pool, adaptive average pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)
        for bn in (self.b1, self.b2):  # statistics that are not the identity, so eval mode tests them
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        x = F.adaptive_avg_pool2d(torch.relu(self.b2(self.c2(x))), 1)
        return self.fc(x.flatten(1))


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.1) -> list[float]:
    """The losses of one SGD step per batch of `data` (token batches, as `batches` gives them)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for idx, targets in data:
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def batches(steps: int, batch: int = 2, context: int = 16, vocab: int = 128, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, context), generator=g), torch.randint(0, vocab, (batch, context), generator=g))
            for _ in range(steps)]
