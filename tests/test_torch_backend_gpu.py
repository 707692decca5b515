"""torch.compile(backend="tecc") on CUDA tensors (marked gpu: the programs run as compiled
kernels on torch's current stream). The CPU counterparts are tests/test_torch_backend.py."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from tecc.torch.report import reports  # noqa: E402

from torch_models import ConvNet, GPT, MLP, batches, fresh_dynamo  # noqa: E402,F401

pytestmark = pytest.mark.gpu


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
    got = _train(torch.compile(twin, backend="tecc", options={"fallback": "error"}), data)
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-4, (expected, got)


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_gpt_trains_like_eager_on_gpu_under_bf16_autocast(attention):
    torch.manual_seed(0)
    model = GPT(width=128, heads=2, context=64, attention=attention).cuda()
    twin = copy.deepcopy(model)
    data = batches(6, batch=4, context=64)
    expected = _train(model, data, torch.bfloat16)
    got = _train(torch.compile(twin, backend="tecc", options={"fallback": "error"}), data, torch.bfloat16)
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 2e-2, (expected, got)
    if attention == "sdpa":  # the backward reaches the FlashAttention-2 kernels (docs/models.md)
        kernels = [k for r in reports() if r.name.endswith("backward") for _, names in r.programs for k in names]
        assert sum("backward_mma" in k for k in kernels) == 2, kernels


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


def _trained_with_and_without(monkeypatch, method, knob, steps):
    """GPT trained eagerly, then compiled twice, the second time with the environment `knob`
    set to 0; `CudaExecutor.method`'s calls counted. Returns the three runs' losses and the
    calls made by the first compiled run and by the second."""
    from tecc.runtime.cuda import CudaExecutor

    calls = []
    plain = getattr(CudaExecutor, method)
    monkeypatch.setattr(CudaExecutor, method, lambda self, *a: calls.append(self.host.name) or plain(self, *a))
    torch.manual_seed(0)
    model = GPT().cuda()
    twins = [copy.deepcopy(model) for _ in range(2)]
    data = batches(steps)
    expected = _train(model, data)
    on = _train(torch.compile(twins[0], backend="tecc", options={"fallback": "error"}), data)
    count = len(calls)
    torch._dynamo.reset()
    monkeypatch.setenv(knob, "0")
    off = _train(torch.compile(twins[1], backend="tecc", options={"fallback": "error"}), data)
    return expected, on, off, count, len(calls) - count


def test_a_training_loop_replays_its_programs_as_cuda_graphs_with_the_same_losses(monkeypatch):
    """The executor's own graphs (tecc/runtime/graphs.py, on by default): steps after the second
    replay each program as one graph -- torch's caching allocator gives the same pointers every
    step -- and train as the plain launches do (TECC_CUDA_GRAPHS=0) and as eager does."""
    expected, with_graphs, plain, launched, launched_off = _trained_with_and_without(
        monkeypatch, "_launch_graph", "TECC_CUDA_GRAPHS", 8)
    assert launched, "no program was replayed as a CUDA graph"
    assert launched_off == 0, "TECC_CUDA_GRAPHS=0 must launch plainly"
    assert max(abs(a - b) for a, b in zip(expected, with_graphs)) <= 1e-4, (expected, with_graphs)
    assert max(abs(a - b) for a, b in zip(plain, with_graphs)) <= 1e-5, (plain, with_graphs)


def test_a_training_loop_with_patched_graphs_trains_like_plain_launches(monkeypatch):
    """TECC_CUDA_GRAPHS=patch (tecc/runtime/graph_patch.py): every program call after a
    program's first hit replays its graph, patched where pointers moved (no call launches
    plainly for new pointers), and trains as the plain launches do."""
    import dataclasses

    from tecc.runtime import graphs

    torch.manual_seed(0)
    model = GPT().cuda()
    twins = [copy.deepcopy(model) for _ in range(2)]
    data = batches(8)
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "0")
    plain = _train(torch.compile(twins[0], backend="tecc", options={"fallback": "error"}), data)
    torch._dynamo.reset()
    monkeypatch.setenv("TECC_CUDA_GRAPHS", "patch")
    before = dataclasses.replace(graphs.TOTALS)
    patched = _train(torch.compile(twins[1], backend="tecc", options={"fallback": "error"}), data)
    after = graphs.TOTALS
    assert after.unpatchable == before.unpatchable, f"a graph could not be patched: {after.unpatchable_why}"
    assert after.launched > before.launched and after.first_sights == before.first_sights, (before, after)
    assert max(abs(a - b) for a, b in zip(plain, patched)) <= 1e-5, (plain, patched)


def test_programs_relaunch_on_pointers_and_still_train_like_eager(monkeypatch):
    """From a compiled graph's second call with inputs of the same layouts, each program is
    relaunched on its new pointers without reading its arguments' keys (tecc/torch/runtime.py,
    CudaExecutor.relaunch); the losses stay eager's. With TECC_RELAUNCH=0 nothing relaunches and
    the losses are the same to the last bit."""
    expected, fast, keyed, relaunched, relaunched_off = _trained_with_and_without(
        monkeypatch, "relaunch", "TECC_RELAUNCH", 6)
    assert relaunched, "no program was relaunched on pointers"
    assert relaunched_off == 0, "TECC_RELAUNCH=0 must not relaunch"
    assert max(abs(a - b) for a, b in zip(expected, fast)) <= 1e-4, (expected, fast)
    assert fast == keyed, (fast, keyed)


def test_a_graph_called_with_inputs_of_other_strides_keys_them_and_relaunches_each():
    """Contiguous and transposed inputs alternate: each layout is keyed once, then relaunched,
    and every call gives eager's result."""
    torch.manual_seed(0)
    model = MLP().cuda()
    run = torch.compile(model, backend="tecc", options={"fallback": "error"}, dynamic=False)
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(32, 16, device="cuda")
            if step % 2:
                x = torch.randn(16, 32, device="cuda").t()
            torch.testing.assert_close(run(x), model(x), rtol=1e-5, atol=1e-5, msg=f"call {step}")


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
        y = torch.compile(fast, backend="tecc", options={"fallback": "error"})(
            x.to(torch.bfloat16).to(memory_format=torch.channels_last))
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
    # one forward graph for the three lengths (its backward is compiled with it: the weights ask grads)
    names = [r.name.split("_", 1)[1] for r in reports()]
    assert names.count("forward") == 1, names


def test_padded_fp16_nhwc_convolution_and_its_backward_on_tensor_cores():
    """The issue's padded 3x3 layer (batch 32, 56x56, 64 -> 64, fp16 channels_last): forward and
    both gradients against cuDNN within fp16 rounding of the float32 sum."""
    torch.manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(32, 64, 56, 56, device="cuda").half().to(memory_format=cl).requires_grad_()
    w = (torch.randn(64, 64, 3, 3, device="cuda") * 0.05).half().to(memory_format=cl).requires_grad_()
    fn = lambda x, w: torch.nn.functional.conv2d(x, w, padding=1)  # noqa: E731
    y = torch.compile(fn, backend="tecc", options={"fallback": "error"})(x, w)
    g = torch.randn_like(y)
    y.backward(g)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = fn(xd, wd)
    want.backward(g.double())
    for got, ref in ((y, want), (x.grad, xd.grad), (w.grad, wd.grad)):
        error = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert error <= 2e-3, error
    assert y.is_contiguous(memory_format=cl)  # its plan on tensor cores: tests/test_torch_conv.py (NVRTC)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_transformers_gpt2_trains_like_eager(implementation):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: the HF GPT-2 test "
                                                              "needs it (pip install transformers)")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     attn_implementation=implementation)
    model = transformers.GPT2LMHeadModel(config).cuda()
    twin = copy.deepcopy(model)

    def loss_of(m):
        return lambda idx, targets: m(input_ids=idx, labels=targets).loss

    data = batches(3, batch=2, context=64, vocab=512)
    losses = {}
    for name, m, run in (("eager", model, loss_of(model)),
                         ("tecc", twin, torch.compile(loss_of(twin), backend="tecc", options={"fallback": "error"}))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        out = []
        for idx, targets in data:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(idx.cuda(), targets.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    assert max(abs(a - b) for a, b in zip(losses["eager"], losses["tecc"])) <= 2e-2, losses
