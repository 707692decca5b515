"""torch.compile(backend="tecc") on CUDA tensors (marked gpu: the programs run as compiled
kernels on torch's current stream). The CPU counterparts are tests/test_torch_backend.py."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from tecc.torch.report import clear_reports, reports  # noqa: E402

from torch_models import GPT, MLP, ConvNet, batches  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    clear_reports()
    yield
    torch._dynamo.reset()


def _train(model, data, autocast=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for idx, targets in data:
        with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = model(idx.cuda(), targets.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_gpt_trains_like_eager_on_gpu_in_float32(attention):
    torch.manual_seed(0)
    model = GPT(attention=attention).cuda()
    twin = copy.deepcopy(model)
    data = batches(4)
    expected = _train(model, data)
    got = _train(torch.compile(twin, backend="tecc"), data)
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-4, (expected, got)


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_gpt_trains_like_eager_on_gpu_under_bf16_autocast(attention):
    torch.manual_seed(0)
    model = GPT(width=128, heads=2, context=64, attention=attention).cuda()
    twin = copy.deepcopy(model)
    data = batches(6, batch=4, context=64)
    expected = _train(model, data, torch.bfloat16)
    got = _train(torch.compile(twin, backend="tecc"), data, torch.bfloat16)
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 2e-2, (expected, got)


def test_programs_run_on_the_callers_stream():
    torch.manual_seed(0)
    model = MLP().cuda()
    run = torch.compile(model, backend="tecc", options={"fallback": "error"})
    x = torch.randn(64, 16, device="cuda")
    run(x)  # compile and warm up on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = run(x * 2)                     # queued after x * 2 on the side stream, no wait needed
    side.synchronize()
    torch.testing.assert_close(y, model(x * 2), rtol=1e-5, atol=1e-5)


def test_cudagraphs_replays_the_graph_with_new_inputs():
    torch.manual_seed(0)
    model = MLP().cuda()
    run = torch.compile(model, backend="tecc", options={"cudagraphs": True, "fallback": "error"})
    with torch.no_grad():
        for step in range(4):              # warm-up, capture, then replays
            x = torch.randn(32, 16, device="cuda")
            torch.testing.assert_close(run(x), model(x), rtol=1e-5, atol=1e-5, msg=f"call {step}")


def test_conv_net_inference_in_bf16_channels_last():
    torch.manual_seed(0)
    model = ConvNet().cuda().eval()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        reference = model(x)
        fast = copy.deepcopy(model).to(torch.bfloat16).to(memory_format=torch.channels_last)
        y = torch.compile(fast, backend="tecc")(x.to(torch.bfloat16).to(memory_format=torch.channels_last))
    error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
    assert error <= 3e-2, error


def test_one_dynamic_compile_serves_three_lengths_on_gpu():
    torch.manual_seed(0)
    model = GPT(context=64, layers=1).cuda()
    twin = copy.deepcopy(model)
    run = torch.compile(twin, backend="tecc", dynamic=True)
    for length in (16, 24, 40):
        idx, targets = (t.cuda() for t in batches(1, context=length, seed=length)[0])
        assert abs(model(idx, targets).item() - run(idx, targets).item()) <= 1e-4, length
    assert [r.name.split("_", 1)[1] for r in reports()] == ["forward"]
