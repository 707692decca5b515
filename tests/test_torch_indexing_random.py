"""torch.compile(backend="tecc") on CPU tensors (the emulator): data-dependent indices (embedding
and its backward, index_put, scatter, out-of-range indices, deterministic mode) and random numbers
(rand, randn, bernoulli, dropout: their statistics, new numbers per call, reproducibility under
torch.manual_seed, and a backward that uses the forward's mask). The per-op comparisons with eager
on torch's own samples are in tests/test_torch_opinfo.py; the GPT with dropout in
tests/test_torch_backend.py."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tecc  # noqa: E402
from tecc.torch.report import reports  # noqa: E402
from torch_models import fresh_dynamo  # noqa: E402,F401  (tests/torch_models.py)


@pytest.fixture(autouse=True)
def nondeterministic_after():
    """fresh_dynamo (tests/torch_models.py) around each test, and torch's deterministic mode off after it."""
    yield
    torch.use_deterministic_algorithms(False)


def compiled(fn, **options):
    return torch.compile(fn, backend="tecc", options={"fallback": "error", **options})


def kernels() -> list[str]:
    return [k for r in reports() for _, names in r.programs for k in names]


def within_sigmas(observed: float, expected: float, sigma: float, count: float = 5) -> bool:
    return abs(observed - expected) <= count * sigma


# ---- data-dependent indices ----------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_embedding_backward_is_a_scatter_add_with_atomics_or_in_a_fixed_order(deterministic):
    torch.use_deterministic_algorithms(deterministic)
    torch.manual_seed(0)
    W = torch.randn(50, 64, requires_grad=True)
    idx = torch.randint(0, 50, (4, 30))          # indices repeat: 120 rows into 50
    y = compiled(lambda W, idx: F.embedding(idx, W, padding_idx=3))(W, idx)
    torch.testing.assert_close(y, W.detach()[idx], rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    keep = (idx != 3).reshape(-1, 1)
    want = torch.zeros(50, 64, dtype=torch.float64).index_add_(0, idx.reshape(-1),
                                                                (g.reshape(-1, 64) * keep).double())
    torch.testing.assert_close(W.grad.double(), want, rtol=1e-5, atol=1e-5)
    assert W.grad[3].abs().max() == 0                # the padding row gets no gradient
    backward = [k for k in kernels() if "embedding_dense_backward" in k]
    # atomics need an initializing kernel first; the deterministic sum is one kernel per output
    assert (len(backward) == 1) == deterministic, backward


def test_an_embedding_index_outside_the_table_is_an_error():
    W, idx = torch.randn(10, 4), torch.tensor([[1, 10]])
    with pytest.raises(tecc.OutOfBoundsError, match="10"):
        compiled(lambda W, idx: F.embedding(idx, W))(W, idx)


def test_overwriting_writes_keep_the_last_write_of_a_repeated_index():
    x, src = torch.randn(6, 5), torch.randn(6, 5)
    index = torch.tensor([[1, 2, 1, 0, 4], [1, 0, 1, 3, 4], [5, 5, 5, 5, 5]])  # repeats in every column
    got = compiled(lambda x, i, s: x.scatter(0, i, s))(x, index, src)
    want = x.clone()
    for k in range(index.shape[0]):                 # in order: the last write wins
        for j in range(index.shape[1]):
            want[index[k, j], j] = src[k, j]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch._dynamo.reset()
    rows, values = torch.tensor([4, 1, 4, -1]), torch.randn(4, 5)   # -1: the last row, as in torch
    got = compiled(lambda x, r, v: torch.index_put(x, (r,), v))(x, rows, values)
    want = x.clone()
    for k in range(4):
        want[rows[k]] = values[k]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_index_put_accumulates_repeated_indices():
    x, rows, cols = torch.randn(5, 7), torch.tensor([0, 3, 0, 4, 0]), torch.tensor([6, 1, 6, -2, 6])
    values = torch.randn(5)
    got = compiled(lambda x, r, c, v: torch.index_put(x, (r, c), v, accumulate=True))(x, rows, cols, values)
    want = x.double().index_put((rows, cols), values.double(), accumulate=True)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


# ---- random numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rand_randn_and_bernoulli_have_their_distributions(dtype):
    n = 1 << 14

    def draws(x):
        return torch.rand_like(x), torch.randn_like(x), torch.bernoulli(torch.full_like(x, 0.3))

    u, z, b = (t.double() for t in compiled(draws)(torch.empty(n, dtype=dtype)))
    assert 0 <= u.min() and u.max() < 1                               # [0, 1), bfloat16 rounding included
    assert within_sigmas(u.mean().item(), 0.5, math.sqrt(1 / 12 / n))
    assert within_sigmas(u.var().item(), 1 / 12, math.sqrt(1 / 180 / n))  # Var of (u - 1/2)^2 = 1/180
    assert within_sigmas(z.mean().item(), 0, 1 / math.sqrt(n))
    assert within_sigmas(z.var().item(), 1, math.sqrt(2 / n) * 1.05)
    assert within_sigmas((z.abs() < 1).double().mean().item(), 0.6827, math.sqrt(0.6827 * 0.3173 / n))
    assert set(b.unique().tolist()) == {0.0, 1.0}
    assert within_sigmas(b.mean().item(), 0.3, math.sqrt(0.21 / n))
    # no correlation between neighbouring elements (Philox words of one call, and of the next)
    for lag in (1, 4):
        corr = torch.corrcoef(torch.stack([u[:-lag], u[lag:]]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(n), (lag, corr)


def test_dropout_draws_a_new_mask_per_call_replays_under_manual_seed_and_its_backward_uses_it():
    p, n = 0.25, 64 * 256
    run = compiled(lambda x: F.dropout(x, p, training=True))
    x = torch.randn(64, 256, requires_grad=True)
    torch.manual_seed(1)
    first = run(x)
    torch.manual_seed(1)
    again = run(x)
    other = run(x)
    kept = first != 0
    assert torch.equal(first, again)                                   # the same generator state
    assert within_sigmas(1 - kept.double().mean().item(), p, math.sqrt(p * (1 - p) / n))
    changed = (kept != (other != 0)).double().mean().item()            # 2p(1-p) of the elements
    assert within_sigmas(changed, 2 * p * (1 - p), math.sqrt(0.375 * 0.625 / n))
    torch.testing.assert_close(first[kept], x.detach()[kept] / (1 - p), rtol=1e-6, atol=0)
    for residue in range(4):                                           # each Philox word drops p
        share = 1 - kept.reshape(-1)[residue::4].double().mean().item()
        assert within_sigmas(share, p, math.sqrt(p * (1 - p) / (n / 4))), residue
    g = torch.randn(64, 256)
    torch.manual_seed(2)
    y = run(x)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(y != 0, g / (1 - p), 0), rtol=1e-6, atol=0)
