"""A language model's loss head through torch.compile(backend="tecc"): logits = x @ W^T, then
F.cross_entropy with an ignore_index, forward and backward.

The row statistics of the log-softmax (amax and sum of exp, keepdim=True in the ATen graph) are
lowered at the rows and read through a view (tecc/torch/lowering/reductions.py), so the region
search (tecc/compiler/region_search.py) finds the row group and row fusion takes it; the NLL's
mean (a gather of the target's log-probability summed over the rows, divided by the count of
targets kept, itself a sum inlined into its cast) is a region of its own, one block reducing the
rows, not one thread.

* In the emulator: the compiled loss and its gradients against float64 NumPy, rows of 1000 and
  1031 columns (not a multiple of any vector width), one target ignored, every output the
  runtime allocates poisoned (NaN) before the kernels write it.
* Planned for sm_90 at GPT-2's size (8192 x 50304 logits), without a GPU: the forward's and the
  backward's passes over the logits are one row kernel each, predicted near the DRAM time of
  the bytes they must move, and no kernel of the head is the naive one-thread fallback. Under
  the min-cut partitioner (the backend's default is a variant of it) the forward saves the bf16 logits and two row
  statistics, and both kernels stream the logits, read once each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from tecc.compiler.program import resolve_target  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IGNORE = -1


class Head(torch.nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(vocab, width) * 0.5)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = x @ self.w.t()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=IGNORE)


def _reference(x: np.ndarray, w: np.ndarray, t: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Loss, dL/dx, dL/dw in float64."""
    z = x @ w.T
    m = z.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
    keep = t != IGNORE
    rows = np.nonzero(keep)[0]
    n = keep.sum()
    loss = (lse[rows] - z[rows, t[rows]]).sum() / n
    dz = np.exp(z - lse[:, None])
    dz[rows, t[rows]] -= 1.0
    dz *= keep[:, None] / n
    return float(loss), dz @ w, dz.T @ x


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """The runtime allocates each program output with torch.empty: fill them with NaN, so an
    element no kernel writes shows."""
    import tecc.torch.runtime as rt

    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        if out.dtype.is_floating_point:
            out.fill_(float("nan"))
        elif out.dtype != torch.bool:
            out.fill_(-12345)
        return out

    monkeypatch.setattr(rt.torch, "empty", empty)


@pytest.mark.parametrize("partitioner", ["default", "min_cut"])
@pytest.mark.parametrize("vocab", [1000, 1031])
def test_cross_entropy_head_matches_float64_in_the_emulator(vocab, partitioner, poisoned_outputs):
    """Either partitioner: min_cut saves the logits and the row statistics, and the backward
    recomputes the probabilities from them."""
    torch._dynamo.reset()
    rng = np.random.default_rng(vocab)
    rows, width = 5, 8
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = Head(vocab, width)
    x = torch.randn(rows, width, requires_grad=True)
    t = torch.from_numpy(rng.integers(0, vocab, rows)).long()
    t[2] = IGNORE
    options = {"fallback": "error", "partitioner": partitioner}
    loss = torch.compile(model, backend="tecc", options=options)(x, t)
    loss.backward()
    want, dx, dw = _reference(x.detach().double().numpy(), model.w.detach().double().numpy(), t.numpy())
    assert abs(loss.item() - want) <= 1e-5 * abs(want), (loss.item(), want)
    assert x.grad is not None and model.w.grad is not None
    assert _rel(x.grad.double().numpy(), dx) <= 1e-5
    assert _rel(model.w.grad.double().numpy(), dw) <= 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("vocab", [1000, 1031])
def test_bfloat16_head_runs_each_pass_over_the_logits_as_one_row_kernel_in_the_emulator(vocab, poisoned_outputs):
    """Under bf16 autocast (the GPT-2 benchmark's): the forward's log-softmax row group and the
    NLL's mean are row kernels, the backward's row sum and its bf16 dX one row kernel; the
    results within bf16's bound (check.REL_TOL) of float64."""
    from tecc.torch.report import clear_reports, reports

    torch._dynamo.reset()
    clear_reports()
    rng = np.random.default_rng(vocab + 1)
    rows, width = 6, 8
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = Head(vocab, width)
    x = torch.randn(rows, width, requires_grad=True)
    t = torch.from_numpy(rng.integers(0, vocab, rows)).long()
    t[4] = IGNORE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(model, backend="tecc", options={"fallback": "error"})(x, t)
    loss.backward()
    # the reference from the operands autocast rounds to bf16
    xb = x.detach().bfloat16().double().numpy()
    wb = model.w.detach().bfloat16().double().numpy()
    want, dx, dw = _reference(xb, wb, t.numpy())
    assert abs(loss.item() - want) <= 1e-2 * abs(want), (loss.item(), want)
    assert x.grad is not None and model.w.grad is not None
    assert _rel(x.grad.double().numpy(), dx) <= 1.6e-2
    assert _rel(model.w.grad.double().numpy(), dw) <= 1.6e-2
    (fwd, bwd) = [kernels for r in reports() for _, kernels in r.programs]
    assert len([k for k in fwd if k.endswith("_rows_kernel")]) == 2, fwd
    assert len([k for k in bwd if k.endswith("_rows_kernel")]) == 1, bwd
    assert not [k for k in bwd if k.startswith("sum_") and not k.endswith("_rows_kernel")], bwd
    torch._dynamo.reset()


def _plan_head(rows: int, vocab: int, partitioner: str = "min_cut"):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_kernels as mk

    torch.manual_seed(0)
    model = Head(vocab, 768)
    x = torch.randn(rows, 768, requires_grad=True)
    t = torch.randint(0, vocab, (rows,))
    graphs = mk.trace(model, (x, t), train=True, autocast=torch.bfloat16, partitioner=partitioner)
    found, fallbacks = mk.plan_model(graphs, "sm_90", log=lambda _: None)
    assert not fallbacks, fallbacks
    return found


@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
def test_cross_entropy_head_plans_one_row_kernel_per_pass_over_the_logits_for_sm_90(partitioner):
    """min_cut (the backend's default): the forward saves the bf16 logits (the GEMM's output)
    and two row statistics, streamed in one online pass (2 bytes per logit); the backward
    recomputes the float32 cast and writes bf16 dX in one pass (4 bytes). default: the forward
    writes float32 log-probabilities, which the backward reads (6 bytes per logit each)."""
    rows, vocab = 8192, 50304
    found = _plan_head(rows, vocab, partitioner)
    assert not [r for r in found if r.strategy == "naive"], [(r.kernels, r.label) for r in found]
    # the forward: amax, the sum of exp (and the log-softmax output, default) in one row kernel
    fwd = [r for r in found if r.graph == "forward" and "amax" in r.nodes]
    assert len(fwd) == 1 and fwd[0].strategy == "row_fused", [(r.kernels, r.label) for r in fwd]
    assert {"amax", "sum_1", "log"} <= set(fwd[0].nodes), fwd[0].nodes
    # the backward: the row sum of the one-hot gradient and dX (bfloat16) in one row kernel
    bwd = [r for r in found if r.graph == "backward" and "sum_4" in r.nodes]
    assert len(bwd) == 1 and bwd[0].strategy == "row_fused" and len(bwd[0].kernels) == 2, \
        [(r.kernels, r.label) for r in bwd]
    if partitioner == "min_cut":  # the logits stream through both, read once each
        assert "cache=online" in fwd[0].label and "cache=none" in bwd[0].label, (fwd[0].label, bwd[0].label)
    # each reads the logits once and writes its output once: near the DRAM time of those bytes
    bandwidth = resolve_target("sm_90").dram_bandwidth
    moved = {"min_cut": (2, 2 + 2), "default": (2 + 4, 4 + 2)}[partitioner]
    for r, per_logit in zip(fwd + bwd, moved):
        assert r.seconds <= 1.25 * rows * vocab * per_logit / bandwidth, (r.kernels, r.seconds, per_logit)
    # the count of kept targets and the NLL's mean: 8192 values each, microseconds
    scalar = [r for r in found if r.graph == "forward" and "div" in r.nodes]
    assert len(scalar) == 1 and scalar[0].seconds < 20e-6, [(r.kernels, r.label, r.seconds) for r in scalar]


def test_the_head_compiles_for_sm_90_without_spills_in_its_row_kernels():
    """NVRTC + ptxas (no GPU): the forward's and backward's programs at GPT-2's size, their row
    kernels (the row statistics, the NLL's mean with its int64 targets cached in registers, the
    backward's row sum and dX) compile without spills."""
    from nvrtc_checks import skip_without_nvrtc

    import tecc as tc
    from tecc.torch.graph import plan_graph
    from tecc.torch.lowering import Sizes

    skip_without_nvrtc("sm_90")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_kernels as mk

    torch.manual_seed(0)
    model = Head(50304, 768)
    x = torch.randn(8192, 768, requires_grad=True)
    t = torch.randint(0, 50304, (8192,))
    graphs = mk.trace(model, (x, t), train=True, autocast=torch.bfloat16)
    rows = []
    for kind, gm in graphs.items():
        for seg in plan_graph(gm, kind, Sizes(), set()).segments:
            f = tc.build(seg.args, target="cuda", arch="sm_90")
            rows += [(k, r) for k, r in f.resources.items() if k.endswith("_rows_kernel")]
    assert len(rows) == 3, [k for k, _ in rows]
    for name, res in rows:
        assert res.spill_stores == 0 and res.spill_loads == 0, (name, res)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA")
@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
@pytest.mark.parametrize("vocab", [50304, 1031])
def test_the_head_on_the_gpu_matches_float64(vocab, partitioner):
    """The compiled head under bf16 autocast on CUDA against float64 from the bf16 operands
    (min_cut at 50,304: both row kernels streamed)."""
    torch._dynamo.reset()
    torch.manual_seed(vocab)
    rows, width = 4096, 768
    model = Head(vocab, width).cuda()
    with torch.no_grad():
        model.w.mul_(0.1)
    x = torch.randn(rows, width, device="cuda", requires_grad=True)
    t = torch.randint(0, vocab, (rows,), device="cuda")
    t[::7] = IGNORE
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.compile(model, backend="tecc", options={"fallback": "error", "partitioner": partitioner})(x, t)
    loss.backward()
    xb = x.detach().bfloat16().double()
    wb = model.w.detach().bfloat16().double().requires_grad_(True)
    xr = xb.clone().requires_grad_(True)
    ref = F.cross_entropy(xr @ wb.t(), t, ignore_index=IGNORE)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item()), (loss.item(), ref.item())
    for got, want in ((x.grad, xr.grad), (model.w.grad, wb.grad)):
        assert got is not None and want is not None
        assert float((got.double() - want).norm() / want.norm()) <= 1.6e-2
    torch._dynamo.reset()


def test_an_unknown_partitioner_is_refused_naming_the_choices():
    from tecc.ir.errors import TeccError
    from tecc.torch.backend import Options

    assert Options.parse(None).partitioner == "recompute"
    assert Options.parse({"partitioner": "default"}).partitioner == "default"
    with pytest.raises(TeccError, match="partitioner='greedy'.*'min_cut'.*'default'"):
        Options.parse({"partitioner": "greedy"})


def test_a_gemm_operand_with_unaligned_rows_is_read_through_one_padded_copy_in_the_emulator(poisoned_outputs,
                                                                                           monkeypatch):
    """A vocabulary of 1031 float32 logits makes rows of 4124 bytes, not a multiple of 16: the
    forward's GEMM writes the logits as they are (its epilogue copies its tile out in runs of a
    row); the backward's two GEMMs over the logits' gradient (dX = dL·W
    with k the vocabulary, dW = dLᵀ·x with m the vocabulary) read one zero-padded copy of it
    ([rows, 1032]), and dX's sum runs over the padded k, W read through a copy with a zero row
    (lowering/matmul.py; the size thresholds lowered so the emulator's sizes take it). Matches
    float64, the outputs poisoned."""
    import tecc.torch.lowering.matmul as mm
    from tecc.torch import graph as tg

    monkeypatch.setattr(mm, "REALIGN_MIN_ELEMENTS", 0)
    made: list[str] = []
    real = tg.LoweringContext.compute

    def compute(self, shape, fcompute, suffix=""):
        out = real(self, shape, fcompute, suffix)
        if suffix in ("_aligned", "_padded"):
            made.append(f"{out.name}{tuple(int(n) for n in out.shape)}")
        return out

    monkeypatch.setattr(tg.LoweringContext, "compute", compute)
    torch._dynamo.reset()
    rng = np.random.default_rng(7)
    rows, width, vocab = 6, 8, 1031
    torch.manual_seed(int(rng.integers(1 << 30)))
    model = Head(vocab, width)
    x = torch.randn(rows, width, requires_grad=True)
    t = torch.from_numpy(rng.integers(0, vocab, rows)).long()
    loss = torch.compile(model, backend="tecc", options={"fallback": "error"})(x, t)
    loss.backward()
    want, dx, dw = _reference(x.detach().double().numpy(), model.w.detach().double().numpy(), t.numpy())
    assert abs(loss.item() - want) <= 1e-5 * abs(want), (loss.item(), want)
    assert _rel(x.grad.double().numpy(), dx) <= 1e-5
    assert _rel(model.w.grad.double().numpy(), dw) <= 1e-5
    # each time a graph is lowered: the backward's gradient copied once for both GEMMs, W with its
    # zero row for dX's padded k; nothing in the forward
    assert sorted(set(made)) == ["mm_1_aligned(6, 1032)", "mm_2_aligned(1032, 8)"], made
    torch._dynamo.reset()


def test_the_head_gemms_over_an_unaligned_vocabulary_plan_on_tma_for_sm_90():
    """transformers' GPT-2 vocabulary (50,257 bf16 logits per row: 100,514-byte rows): the
    backward's GEMMs read the logits' gradient through one padded copy and load both operands
    by TMA (unpadded, their rows refused a tensor map and cp.async's 16-byte copies; 3.4-3.8 ms
    each on an H200, 0.8-1.1 ms padded); the forward's GEMM writes the logits as they are, its
    tiles staged in shared memory and copied out by the threads (TMA cannot store those rows; it
    was a product padded to 50,264 columns and copied out: 1.03 + 0.77 ms, the register epilogue
    2.39)."""
    found = _plan_head(8192, 50257)
    rows = [(r.graph, r.kernels, r.label) for r in found]
    gemms = [r for r in found if r.strategy == "gemm_wgmma"]
    assert len(gemms) == 3 and all("TMA producer" in r.label for r in gemms), rows
    copies = [r for r in found if any(k.endswith("_aligned_kernel") for k in r.kernels)]
    # dL and W; W's bf16 cast (made row-major, [768, 50257], in the program) with zero columns
    assert sorted(r.graph for r in copies) == ["backward", "backward", "forward"], rows
    forward = [r for r in gemms if r.graph == "forward"]
    assert tuple(forward[0].kernels) == ("mm_kernel",) and "the threads' stores" in forward[0].label, rows


def test_two_products_over_different_memory_of_one_tensor_read_their_own_padded_copies(monkeypatch):
    """`x @ w + x.t().contiguous() @ w` with x's rows unaligned (6 float32, 24 bytes): the second
    product's operand is a copy (its own storage) with the same sizes and strides as x, so it
    gets its own padded copy, not x's (a copy is shared only between views of one storage)."""
    import tecc.torch.lowering.matmul as mm

    monkeypatch.setattr(mm, "REALIGN_MIN_ELEMENTS", 0)

    def f(x, w):
        return x @ w + x.t().contiguous() @ w

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 6, generator=gen), torch.randn(6, 5, generator=gen)
    got = torch.compile(f, backend="tecc", options={"fallback": "error"})(x, w)
    want = f(x.double(), w.double())
    assert _rel(got.double().numpy(), want.numpy()) <= 1e-6
    torch._dynamo.reset()
