"""Models written by others, unmodified, through torch.compile(model, backend="tecc"):
transformers' GPT2LMHeadModel (its own attention code, "eager" and "sdpa") training, and
torchvision's resnet50 in eval, channels_last, both with fallback="error".

On the CPU (the emulator) with small configurations: a 2-layer GPT-2 of width 64 trains 4 steps
with losses and gradients within 1e-4 of eager; with dropout on, where tecc's random numbers are
not torch's, the same seed gives the same loss, the gradient is the derivative of the forward
with its own masks, and the attention weights the model returns are dropped at its rate; resnet50
on one 32x32 image matches eager within 1e-4. The GPU tests (@pytest.mark.gpu) take the full
sizes of docs/models.md (benchmarks/models_hf.py times them).

transformers and torchvision are not dependencies of tecc: each test skips when its package is
absent (CI does not install them; the tests of torch alone still run there, in a few seconds).
With both present the CPU tests take about 2.5 minutes on the 2-core machine (resnet50 20-45 s,
each GPT-2 test 15-25 s).
"""

from __future__ import annotations

import copy
import sys

import pytest

torch = pytest.importorskip("torch")

from torch_models import fresh_dynamo  # noqa: E402,F401  (tests/torch_models.py)
from tecc.torch.report import reports  # noqa: E402


def _import_torchvision():
    """torchvision, or None. A torchvision wheel built against another torch (PyPI's CUDA build
    next to a CPU torch) fails in its import registering fake kernels for its C++ detection ops
    (nms, roi_align), which these models never call; transformers imports torchvision when it is
    installed, so it fails the same way. Then the import is retried with those registrations
    skipped: the model code imported is torchvision's own, unmodified."""
    try:
        import torchvision
        return torchvision
    except ImportError:
        return None
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    register = torch.library.register_fake
    torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)
    try:
        import torchvision
        return torchvision
    except ImportError:
        return None
    finally:
        torch.library.register_fake = register


torchvision = _import_torchvision()


def _transformers():
    return pytest.importorskip("transformers")


def _torchvision():
    if torchvision is None:
        pytest.skip("torchvision is not installed")
    return torchvision


def compiled(model):
    return torch.compile(model, backend="tecc", options={"fallback": "error"})


def assert_no_fallback():
    assert reports(), "nothing was compiled"
    for r in reports():
        assert not r.fallbacks, r.summary()


# ---- what these models needed: tensor constants -------------------------------------------------

def test_tensor_constants_of_the_traced_code_are_program_inputs():
    """`torch.tensor(...)` inside a model is a constant of the ATen graph (a get_attr node):
    transformers' key/value cache starts as `torch.tensor([])` and concatenates onto it. The
    constants become inputs of the compiled graph, so nothing runs in Python."""
    def f(x):
        start = torch.tensor([])
        scale = torch.tensor([1.5, -2.0, float("nan"), float("inf"), 0.25])
        return torch.cat([start, x * scale], 0).sum(0), (x + torch.tensor(3.0)).exp()

    x = torch.randn(7, 5, requires_grad=True)
    twin = x.detach().clone().requires_grad_(True)
    got = compiled(f)(twin)
    expected = f(x)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    (got[1] * got[0][:1].nan_to_num(0.0, 0.0, 0.0)).sum().backward()
    (expected[1] * expected[0][:1].nan_to_num(0.0, 0.0, 0.0)).sum().backward()
    torch.testing.assert_close(twin.grad, x.grad, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert_no_fallback()


def test_a_graph_with_constants_loads_from_the_disk_cache_with_them(tmp_path, monkeypatch):
    import tecc.torch.backend as backend

    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    # programs with cubins (built for CUDA: NVRTC needs no GPU), run in the emulator on CPU tensors
    monkeypatch.setattr(backend, "_target", lambda emulate: "cuda")

    def f(x):
        return torch.cat([torch.tensor([]), x * torch.tensor([2.0, -1.0, 0.5])], 0)

    x = torch.randn(4, 3)
    first = compiled(f)(x)
    torch._dynamo.reset()

    def no_planning(*args, **kwargs):
        raise AssertionError("the second compile planned the graph instead of loading it")

    monkeypatch.setattr(backend, "plan_graph", no_planning)
    second = compiled(f)(x)
    torch.testing.assert_close(first, f(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_the_loss_backward_over_gpt2s_full_vocabulary_is_lowered():
    """The cross-entropy backward of GPT-2 small (8192 tokens x 50257 classes, 411M elements)
    writes -1 at one position per row (a scatter of one index position): elementwise, however
    large, so it is lowered, not refused as a search (traced with fake tensors, planned only)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from tecc.torch.decompositions import decomposition_table
    from tecc.torch.graph import plan_graph
    from tecc.torch.lowering import Sizes

    def loss_grad(logits, target):
        logits = logits.detach().requires_grad_(True)
        return torch.autograd.grad(torch.nn.functional.cross_entropy(logits, target), logits)

    logits = torch.empty(8192, 50257)
    target = torch.empty(8192, dtype=torch.int64)
    gm = make_fx(loss_grad, decomposition_table=decomposition_table(), tracing_mode="fake")(logits, target)
    assert any(n.target is torch.ops.aten.scatter.value for n in gm.graph.nodes), gm.code
    plan = plan_graph(gm, "loss_backward", Sizes(), set())
    assert not plan.fallbacks, plan.reasons


def test_a_one_position_scatter_matches_eager_with_nan_and_odd_sizes():
    """The same one-position-per-row scatter run in the emulator: odd sizes, NaN and infinities
    in the input it overwrites, the scattered value at the first and the last column."""
    x = torch.randn(37, 53)
    x[0, 0], x[1, 5], x[2, 52] = float("nan"), float("inf"), -float("inf")
    index = torch.randint(0, 53, (37, 1))
    index[0, 0], index[3, 0] = 0, 52

    def f(x, index):
        return torch.scatter(x, 1, index, -1.0), torch.scatter(x, 1, index, x[:, :1] * 2)

    for got, expected in zip(compiled(f)(x, index), f(x, index)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert_no_fallback()


# ---- transformers' GPT-2 ---------------------------------------------------------------------------

def gpt2(attention: str, dropout: float = 0.0):
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout, attn_implementation=attention)
    return transformers.GPT2LMHeadModel(config).train()


def token_batches(steps: int, batch: int = 2, length: int = 16):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (batch, length), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_lm_head_model_trains_four_steps_like_eager(attention):
    model = gpt2(attention)
    twin = copy.deepcopy(model)
    run = compiled(twin)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for step, ids in enumerate(token_batches(4)):
        expected = model(input_ids=ids, labels=ids)
        got = run(input_ids=ids, labels=ids)
        expected.loss.backward()
        got.loss.backward()
        assert abs(got.loss.item() - expected.loss.item()) <= 1e-4, (step, got.loss.item(), expected.loss.item())
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}, {name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_no_fallback()
    # the model's graph and, after transformers' own graph break (a logger call in
    # `loss_function`), the loss's: each one program
    assert all(len(r.programs) == 1 for r in reports()), [r.summary() for r in reports()]


def test_gpt2_bf16_built_for_sm_90_is_stored_in_the_graph_cache(tmp_path, monkeypatch):
    """Under bf16 autocast the forward program is planned in regions (the attention's online
    kernel next to tensor-core GEMMs); the composed module is saved without the GEMMs' schedule
    records, which the saved loop IR does not hold (built for sm_90 with NVRTC, no GPU, and run
    in the emulator)."""
    import tecc.torch.backend as backend

    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    monkeypatch.setattr(backend, "_target", lambda emulate: "cuda")
    model = gpt2("sdpa")
    ids = token_batches(1)[0]
    run = torch.compile(model, backend="tecc", options={"fallback": "error", "arch": "sm_90"})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(input_ids=ids, labels=ids).loss
        expected = model(input_ids=ids, labels=ids).loss
    got.backward()
    assert abs(got.item() - expected.item()) <= 2e-2, (got.item(), expected.item())
    assert len(list((tmp_path / "graphs").rglob("graph.json"))) == len(reports()) == 4
    assert_no_fallback()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_gpt2_lm_head_model_with_dropout_trains_on_its_own_masks(attention):
    """tecc draws its masks from its own generator (seeded from torch's), so the losses cannot be
    eager's: the same seed gives the same loss, the next call new masks, the gradient is the
    derivative of the forward with its masks (a central difference along a random direction),
    and a few SGD steps on one batch lower the loss."""
    model = gpt2(attention, dropout=0.1)
    run = compiled(model)
    ids = token_batches(1)[0]

    def loss_at(seed):
        torch.manual_seed(seed)
        return run(input_ids=ids, labels=ids).loss

    loss = loss_at(5)
    assert loss.item() == loss_at(5).item()
    assert loss.item() != run(input_ids=ids, labels=ids).loss.item()
    loss = loss_at(5)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    gen = torch.Generator().manual_seed(2)
    direction = [torch.randn(p.shape, generator=gen) for p in params]
    slope = sum((p.grad * d).sum() for p, d in zip(params, direction)).item()
    eps = 3e-4  # a step along all ~120k weights at once: eager's own difference is off by 8% at 3e-3, 0.1% here
    with torch.no_grad():
        for p, d in zip(params, direction):
            p += eps * d
    plus = loss_at(5).item()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p -= 2 * eps * d
    minus = loss_at(5).item()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p += eps * d
    assert abs((plus - minus) / (2 * eps) - slope) <= 5e-3 * abs(slope), (plus, minus, slope)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    losses = []
    for step in range(3):
        loss = loss_at(10 + step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert_no_fallback()


def test_gpt2_attention_dropout_drops_at_its_rate():
    """The "eager" attention returns its weights after dropout (output_attentions=True): of the
    weights the causal mask keeps, a fraction p is zero, and the others are scaled by 1/(1-p)
    (each row sums to 1 on average)."""
    model = gpt2("eager", dropout=0.1)
    ids = token_batches(1, batch=4)[0]
    torch.manual_seed(3)
    with torch.no_grad():
        out = compiled(model)(input_ids=ids, output_attentions=True)
    weights = torch.stack(out.attentions)                      # (layers, batch, heads, 16, 16)
    kept = torch.ones(16, 16, dtype=torch.bool).tril()
    lower = weights[..., kept]
    assert (weights[..., ~kept] == 0).all()
    rate = (lower == 0).float().mean().item()                  # 4352 weights: sd of the rate 0.0045
    assert abs(rate - 0.1) <= 0.025, rate
    rows = weights.sum(-1)
    assert abs(rows.mean().item() - 1.0) <= 0.03, rows.mean().item()
    assert_no_fallback()


# ---- torchvision's resnet50 ------------------------------------------------------------------------

def test_resnet50_channels_last_in_eval_matches_eager():
    """resnet50 (its 16 bottleneck blocks, batch norm in eval, max pool, adaptive average pool, the
    classifier) on one 32x32 channels_last image: within 1e-4 of eager, relative to the largest
    logit."""
    tv = _torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet50().eval().to(memory_format=torch.channels_last)
    x = torch.randn(1, 3, 32, 32).to(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model(x)
        got = compiled(model)(x)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    assert error <= 1e-4, error
    assert_no_fallback()


# ---- the full sizes, on a GPU ----------------------------------------------------------------------

@pytest.mark.gpu
def test_gpt2_small_bf16_sdpa_trains_20_steps_like_eager_on_the_gpu():
    """GPT2LMHeadModel(GPT2Config()) (124M, random weights), batch 8 x 1024 tokens, bf16 autocast,
    SDPA, dropout 0, AdamW: 20 steps within 2e-2 of eager's losses."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    base = transformers.GPT2LMHeadModel(config).cuda().train()
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, config.vocab_size, (8, 1024), generator=g).cuda() for _ in range(20)]
    losses = {}
    for backend in ("eager", "tecc"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = model if backend == "eager" else compiled(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[backend] = []
        for ids in data:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[backend].append(loss.item())
        del model, run, opt
    worst = max(abs(a - b) for a, b in zip(losses["eager"], losses["tecc"]))
    assert worst <= 2e-2, losses
    assert_no_fallback()


@pytest.mark.gpu
def test_resnet50_bf16_channels_last_batch_32_matches_eager_on_the_gpu():
    """resnet50 in eval, bf16, channels_last, batch 32 x 224²: relative error against eager in
    float32 at most 3e-2 (inductor's is about 1.1e-2)."""
    tv = _torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet50().cuda().eval()
    x = torch.randn(32, 3, 224, 224, device="cuda")
    with torch.no_grad():
        reference = model(x).float()
        model = model.to(torch.bfloat16).to(memory_format=torch.channels_last)
        y = compiled(model)(x.to(torch.bfloat16).to(memory_format=torch.channels_last))
    error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
    assert error <= 3e-2, error
    assert_no_fallback()


HF_CHILD = r"""
import json, os, sys
import torch
sys.path.insert(0, "tests")
from test_torch_hf_models import gpt2, token_batches
from tecc.torch import backend, direct
backend._target = lambda emulate: "cuda"   # graphs in the disk cache (cubins, run in the emulator)
model = gpt2(os.environ["ATTENTION"])
run = torch.compile(model, backend="tecc", options={"fallback": "error"})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for ids in token_batches(2):
    out = run(input_ids=ids, labels=ids)
    out.loss.backward()
    grad = float(model.lm_head.weight.grad.double().abs().sum())
    opt.step(); opt.zero_grad()
    losses.append(out.loss.item())
print(json.dumps({"losses": losses, "grad": grad, "direct": direct.STATS}))
"""


@pytest.mark.parametrize("attention", ["sdpa"])
def test_gpt2_lm_head_model_in_a_later_process_skips_aotautograd(attention, tmp_path):
    """transformers' GPT-2 in two processes with tecc's caches: the model's graph is recorded
    (tecc/torch/direct.py) and the next process calls it without AOTAutograd, training exactly
    as the first; the loss's graph (after transformers' graph break) returns a view, which
    AOTAutograd's runtime regenerates, so it is not recorded and keeps AOTAutograd's cache."""
    import json
    import os
    import subprocess
    from pathlib import Path

    _transformers()
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join(p for p in (str(root), *sys.path) if p)
    env = dict(os.environ, PYTHONPATH=path, TECC_CACHE_DIR=str(tmp_path / "tecc"), ATTENTION=attention,
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch"), TECC_BUILD_CACHE="1")
    env.pop("TECC_NO_CACHE", None)
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", HF_CHILD], cwd=root, env=env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["direct"]["stored"] == 1, first
    assert first["direct"]["not_recorded"] == "an output aliases an input or another output", first
    assert second["direct"]["hits"] == 1, second
    assert second["losses"] == first["losses"] and second["grad"] == first["grad"]
